"""int8 weights (model/quantize.py, csrc/linear.cpp linear_w8) against a torch
reference that dequantizes the same weights: the kernel's product is that
fp32 matmul up to summation order (each value times its group's scale first),
for every row count the kernel tiles differently, partial last panels, group
sizes from 16 to a whole row, fp32 and bf16 activations, with and without a
bias."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepserve.errors import ModelLoadError
from deepserve.model import kernels
from deepserve.model.layers import Linear
from deepserve.model.quantize import (dequantize_int4, dequantize_int8, quantize_int4,
                                      quantize_int8)

ROOT = Path(__file__).resolve().parents[2]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")


def test_quantize_int8_rounds_to_nearest_per_group():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.01, 2.0]])
    q, s = quantize_int8(w, group=3)  # 3 does not divide 4: one scale a row
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 1)
    torch.testing.assert_close(s[:, 0], torch.tensor([1 / 127, 1.0, 3 / 127]))
    assert q[0].tolist() == [64, -127, 32, 0]  # 63.5 rounds to even: 64
    assert q[1].tolist() == [0, 0, 0, 0]  # an all-zero row: scale 1, q 0
    assert q[2, 0] == 127 and q[2, 2] == 0  # the largest maps to 127; a tiny one to 0
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s / 2 + 1e-7).all()  # at most half a step off
    q2, s2 = quantize_int8(w, group=2)  # two groups a row, each its own scale
    torch.testing.assert_close(s2, torch.tensor([[1 / 127, 0.25 / 127], [1.0, 1.0],
                                                 [3 / 127, 2 / 127]]))
    assert q2[0].tolist() == [64, -127, 127, 0] and q2[2].tolist() == [127, 64, -1, 127]
    big = torch.randn(64, 256)
    errs = [(dequantize_int8(*quantize_int8(big, g)) - big).abs().mean() for g in (32, 256)]
    assert errs[0] < errs[1]  # smaller groups, finer steps


@needs_kernels
@pytest.mark.parametrize("n,k,group", [(1152, 576, 32), (576, 1536, 32), (100, 40, 32),
                                       (16, 16, 16), (33, 64, 64), (64, 96, 32), (48, 128, 128)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 32, 97])
def test_linear_w8_matches_the_dequantized_fp32_matmul(m, n, k, group):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    q, s = quantize_int8(torch.randn(n, k, generator=gen) * torch.rand(1, k, generator=gen),
                         group)  # columns of unequal size: the groups' scales differ
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    weight = dequantize_int8(q, s)
    packed, s = kernels.pack_linear_w8(q, s, a8=False)
    assert packed.dtype == torch.int8 and packed.shape == (-(-n // 16), k, 16)
    assert s.shape == (-(-n // 16), k // group if k % group == 0 else 1, 16)
    assert torch.equal(_unpacked(packed, s, n), weight)  # the layout the kernel reads
    ref = F.linear(x.float(), weight, b.float())
    out32 = kernels.linear_w8(x.float(), packed, s, b, n)
    torch.testing.assert_close(out32, ref, rtol=1e-5, atol=1e-4 * k ** 0.5)
    out16 = kernels.linear_w8(x, packed, s, b, n)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, ref.to(torch.bfloat16), rtol=1.6e-2, atol=1e-3 * k ** 0.5)
    no_bias = kernels.linear_w8(x.float(), packed, s, None, n)
    torch.testing.assert_close(no_bias, ref - b.float(), rtol=1e-5, atol=1e-4 * k ** 0.5)


def _a8_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                  mins: torch.Tensor | None = None) -> torch.Tensor:
    """What the int8-activation path computes, in torch: x quantized per row and group as the
    kernel does (round half to even, +-127), integer dot products per group, then
    both scales."""
    m, k = x.shape
    groups = s.shape[1]
    g = k // groups
    xg = x.float().view(m, groups, g)
    amax = xg.abs().amax(dim=2)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(xg * (1 / sx)[:, :, None]).clamp(-127, 127).to(torch.int64)
    dots = torch.einsum("mgk,ngk->mng", xq, q.view(-1, groups, g).to(torch.int64)).double()
    out = dots * sx.double()[:, None, :] * s.double()[None, :, :]
    if mins is not None:  # + each group's min times the sum of its (quantized) inputs
        out += (sx * xq.sum(dim=2)).double()[:, None, :] * mins.double()[None, :, :]
    return out.sum(dim=2).float()


A8_CASES = [(1152, 576, 32), (576, 1536, 32), (100, 40, 8), (16, 64, 64), (33, 64, 32),
            (48, 128, 128)]
"""(n, k, group) of the int8-activation tests; the int4 ones take those whose
group 4 divides (all) and k a multiple of the group."""


def _check_a8(m: int, n: int, k: int, group: int, bits: int = 8) -> None:
    gen = torch.Generator().manual_seed(m * 7 + n)
    weight = torch.randn(n, k, generator=gen) * torch.rand(1, k, generator=gen)
    mins = None
    if bits == 4:
        q, s, mins = quantize_int4(weight, group)
        packed, ps = kernels.pack_linear_w4(q, s, mins)
        assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 16), k // 4, 32)
        assert ps.shape == (-(-n // 16), k // group, 48)
    else:
        q, s = quantize_int8(weight, group)
        packed, ps = kernels.pack_linear_w8(q, s, a8=True)
        assert packed.shape == (-(-n // 16), k // 4, 64)
        assert ps.shape == (-(-n // 16), k // group, 32)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x[0, :group] = 0.0  # a group of zeros: scale 1, nothing added
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    ref = _a8_reference(x, q, s, mins)
    out = kernels.linear_w8(x.float(), packed, ps, b, n)
    torch.testing.assert_close(out, ref + b.float(), rtol=1e-5, atol=1e-4 * k ** 0.5)
    out16 = kernels.linear_w8(x, packed, ps, None, n)
    torch.testing.assert_close(out16, ref.to(torch.bfloat16), rtol=1.6e-2, atol=1e-3 * k ** 0.5)
    weight = dequantize_int8(q, s) if mins is None else dequantize_int4(q, s, mins)
    exact = F.linear(x.float(), weight)  # and near the unquantized product
    assert (out16.float() - exact).abs().mean() <= 0.02 * exact.abs().mean() + 1e-6


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k,group", A8_CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
def test_the_int8_activation_path_is_its_reference_exactly(m, n, k, group, bits):
    """int8 activations (per row and group) times int8 (or int4) weights, summed in
    int32: the same numbers as the reference's integer sums, scaled alike (this
    CPU's path: kernels.int8_isa())."""
    _check_a8(m, n, k, group, bits)


@needs_kernels
def test_the_avx2_int8_activation_path_on_a_vnni_cpu_too():
    """Where this CPU runs VNNI, the AVX2 path (another instruction sequence) is
    checked in a process that keeps it ($DEEPSERVE_KERNEL_ISA=avx2)."""
    if kernels.int8_isa() != "avx512-vnni":
        pytest.skip("this CPU runs the AVX2 path already (the test above)")
    code = ("from deepserve.model import kernels\n"
            "from tests.model.test_quantized_linear import A8_CASES, _check_a8\n"
            "assert kernels.available() and kernels.int8_isa() == 'avx2'\n"
            "for case in A8_CASES:\n"
            "    for m in (1, 3, 5, 33):\n"
            "        for bits in (8, 4):\n"
            "            _check_a8(m, *case, bits)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "DEEPSERVE_KERNEL_ISA": "avx2"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _unpacked(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The (n, K) fp32 weight packed panels and scales stand for, unpacked by hand."""
    k = packed.shape[1]
    w = packed.permute(0, 2, 1).reshape(-1, k).float()
    s = scales.permute(0, 2, 1).reshape(w.shape[0], -1)
    return (w * s.repeat_interleave(k // s.shape[1], dim=1))[:n]


@needs_kernels
def test_linear_w8_takes_extreme_int8_values_and_refuses_wrong_operands():
    q = torch.full((16, 64), -127, dtype=torch.int8)
    q[:, ::2] = 127
    s = torch.linspace(0.5, 2.0, 32).view(16, 2)  # two groups of 32
    x = torch.ones(3, 64)
    packed, ps = kernels.pack_linear_w8(q, s, a8=False)
    out = kernels.linear_w8(x, packed, ps, None, 16)
    assert torch.equal(out, torch.zeros(3, 16))  # 16 * 127 - 16 * 127 a group, exactly
    x[:, 1::2] = 0
    out = kernels.linear_w8(x, packed, ps, None, 16)
    torch.testing.assert_close(out, (16 * 127 * s.sum(1)).expand(3, 16))
    with pytest.raises(RuntimeError, match="scales must be"):
        kernels.linear_w8(x, packed, ps[:, :, :8].contiguous(), None, 16)
    with pytest.raises(RuntimeError, match="G dividing K"):
        kernels.linear_w8(x, packed, torch.ones(1, 3, 16), None, 16)
    with pytest.raises(RuntimeError, match="packed must be"):
        kernels.linear_w8(x, kernels.pack_linear_weight(q.to(torch.bfloat16)), ps, None, 16)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        kernels.linear_w8(torch.ones(3, 16), packed, ps, None, 16)


@needs_kernels
@pytest.mark.parametrize("max_rows", [3, None])
def test_an_int8_linear_is_the_same_model_on_either_path(monkeypatch, max_rows):
    """Where torch serves larger inputs (kernel_max_rows), its weight is the
    dequantized one: the kernel's rows and torch's agree; the bf16 original
    is gone either way."""
    monkeypatch.setattr(kernels, "kernel_max_rows", lambda: max_rows)
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=False).to(torch.bfloat16)
    original = lin.weight.detach().clone()
    lin.pack(free_weight=True, quantize="int8")
    assert lin.packed.dtype == torch.int8 and lin.scales.shape[:2] == (3, 2)  # 64 / 32 groups
    q, s = quantize_int8(original)
    ref = dequantize_int8(q, s)
    x = torch.randn(8, 64).to(torch.bfloat16)
    small, big = lin(x[:2]), lin(x)
    torch.testing.assert_close(small.float(), F.linear(x[:2].float(), ref), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(big.float(), F.linear(x.float(), ref), rtol=2e-2, atol=5e-2)
    if max_rows is None:
        assert lin.weight.numel() == 0
    else:
        assert torch.equal(lin.weight, ref.to(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("env, shape", [(None, (2, 16, 64)), ("1", (2, 16, 64)),
                                        ("0", (2, 64, 16))])
def test_int8_activations_are_the_default_and_can_be_turned_off(monkeypatch, env, shape):
    if env is None:
        monkeypatch.delenv("DEEPSERVE_INT8_ACTIVATIONS", raising=False)
    else:
        monkeypatch.setenv("DEEPSERVE_INT8_ACTIVATIONS", env)
    q, s = quantize_int8(torch.randn(32, 64))
    assert kernels.pack_linear_w8(q, s)[0].shape == shape
    q, s = quantize_int8(torch.randn(32, 42))  # one group of 42 a row: 4 does not divide it
    assert kernels.pack_linear_w8(q, s)[0].shape == (2, 42, 16)  # fp32 activations


def test_quantize_int4_spans_each_group_from_its_min_to_its_max():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0, 2.0, 1.0, -0.5, 0.1],
                      [0.0, 0.0, 0.0, 0.0, -3.0, 1.5, 0.0, 3.0]])
    q, s, m = quantize_int4(w, group=4)
    torch.testing.assert_close(s, torch.tensor([[1.5 / 15, 2.5 / 15], [1.0, 6.0 / 15]]))
    torch.testing.assert_close(m, torch.tensor([[-1.0, -0.5], [0.0, -3.0]]))
    assert q[0].tolist() == [15, 0, 12, 10, 15, 9, 0, 4]  # 0.25 -> 12.5 rounds to even
    assert q[1].tolist() == [0, 0, 0, 0, 0, 11, 8, 15]  # 1.5 -> 11.25; 0 -> 7.5 -> 8
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    err = (dequantize_int4(q, s, m) - w).abs()
    assert (err <= s.repeat_interleave(4, dim=1) / 2 + 1e-6).all()  # half a step at most
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_int4(torch.randn(4, 40))
    big = torch.randn(64, 256)
    err4 = (dequantize_int4(*quantize_int4(big)) - big).abs().mean()
    err8 = (dequantize_int8(*quantize_int8(big)) - big).abs().mean()
    assert err8 < err4 < 0.2 * big.abs().mean()  # coarser than int8, still close


def test_quantized_weights_need_the_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    lin = Linear(16, 16, bias=False).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs the C.. kernels"):
        lin.pack(free_weight=True, quantize="int8")


def test_a_float32_model_is_refused_for_int8(tiny_model):
    from deepserve.model.loader import load_model
    with pytest.raises(ModelLoadError, match="needs a bfloat16 model"):
        load_model(tiny_model, "float32", quantize="int8")


@needs_kernels
@pytest.mark.slow
def test_a_te_of_processes_serves_the_int8_model_it_was_told(tiny_model):
    """quantize reaches the worker process: its greedy tokens and logprobs are the
    in-process int8 engine's, not the bf16 one's."""
    from deepserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    prompt = "The int8 weights"
    runs = {}
    for name, options in (("bf16", {}), ("int8", {"quantize": "int8"}),
                          ("int8 processes", {"quantize": "int8", "processes": True})):
        llm = LLM(str(tiny_model), dtype="bfloat16", num_kv_blocks=64, **options)
        try:
            [out] = llm.generate([prompt], params)
        finally:
            llm.shutdown()
        runs[name] = (out.token_ids, [t.logprob for t in out.logprobs])
    assert runs["int8 processes"][0] == runs["int8"][0]
    torch.testing.assert_close(runs["int8 processes"][1], runs["int8"][1], rtol=0, atol=1e-5)
    assert runs["int8"][1] != runs["bf16"][1]  # the quantized model is another model
    # (how close to the original: tools/bench_quant.py's perplexity on the real model)
