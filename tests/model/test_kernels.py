"""The C++ kernels against the torch path they replace (model/kernels.py).

linear_bf16 is compared with an fp32 matmul of the same bf16 values (it
accumulates in fp32, so it is that product up to summation order and the
final rounding); paged_decode_attention with the torch gather + SDPA path
on the same pool, over shuffled block tables, contexts that end inside, at
and just past block boundaries, GQA groups and the local head counts of
tensor-parallel shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepserve.model import attention, kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")


@pytest.mark.parametrize("n,k", [(1152, 896), (896, 4864), (100, 40), (16, 16), (33, 64)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 32, 97, 200])
def test_linear_matches_fp32_matmul(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    packed = kernels.pack_linear_weight(w)
    ref = F.linear(x.float(), w.float(), b.float())  # (m, n)
    out32 = kernels.linear_bf16(x.float(), packed, b, n)
    torch.testing.assert_close(out32, ref, rtol=1e-5, atol=1e-4 * k ** 0.5)
    out16 = kernels.linear_bf16(x, packed, b, n)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, ref.to(torch.bfloat16), rtol=1.6e-2, atol=1e-3 * k ** 0.5)
    no_bias = kernels.linear_bf16(x.float(), packed, None, n)
    torch.testing.assert_close(no_bias, ref - b.float(), rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("m,n", [(1, 48), (7, 40), (97, 1152)])
def test_linear_bf16_output_is_its_fp32_output_rounded(m, n):
    """bf16 out = the fp32 out (the same sums) rounded to nearest even, bias
    and all, in whole panels (rounded 16 at a time) and a partial last one
    alike (n = 40: 16 + 16 + 8); NaN stays NaN, a sum past bf16's range inf."""
    gen = torch.Generator().manual_seed(m + n)
    k = 64
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x[0, :] = 0.0
    x[0, 0] = 1.0  # row 0 = w[:, 0] + b: sums of two bf16 values, ties among them
    if m > 1:
        x[1, 0] = float("nan")
    packed = kernels.pack_linear_weight(w)
    rounded = kernels.linear_bf16(x.float(), packed, b, n).to(torch.bfloat16)  # torch: RNE
    out16 = kernels.linear_bf16(x, packed, b, n)
    finite = [i for i in range(m) if i != 1]
    assert torch.equal(out16[finite].view(torch.int16), rounded[finite].view(torch.int16))
    if m > 1:
        assert out16[1].isnan().all()
    big = torch.full((1, k), 3e38, dtype=torch.bfloat16)
    ones = kernels.pack_linear_weight(torch.ones(16, k, dtype=torch.bfloat16))
    assert kernels.linear_bf16(big, ones, None, 16).isinf().all()


def test_linear_keeps_leading_dims():
    w = torch.randn(48, 32).to(torch.bfloat16)
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    out = kernels.linear_bf16(x, kernels.pack_linear_weight(w), None, 48)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("max_rows,free_kept", [(3, True), (None, False)])
def test_linear_routes_by_rows_where_torch_wins(monkeypatch, max_rows, free_kept):
    """Where torch's bf16 matmul wins past a few rows (kernel_max_rows, CPUs
    with native bf16), a packed Linear sends inputs of up to that many rows
    to the kernel and larger ones to torch, keeping both copies of the
    weight; elsewhere the kernel serves every size and the copy is freed.
    The lm_head (always=True) stays on the kernel at every size."""
    from deepserve.model.layers import Linear
    monkeypatch.setattr(kernels, "kernel_max_rows", lambda: max_rows)
    calls, real = [], kernels.linear_bf16

    def spy(x, *args):
        calls.append(x.numel() // x.shape[-1])  # rows sent to the kernel
        return real(x, *args)

    monkeypatch.setattr(kernels, "linear_bf16", spy)
    lin, head = Linear(64, 48, bias=True).to(torch.bfloat16), Linear(64, 48, bias=False)
    head = head.to(torch.bfloat16)
    w, b = lin.weight.detach().float().clone(), lin.bias.detach().float().clone()
    lin.pack(free_weight=True)
    head.pack(free_weight=True, always=True)
    assert (lin.weight.numel() > 0) == free_kept and head.weight.numel() == 0
    for m in (1, 3, 4, 9):
        x = torch.randn(m, 64).to(torch.bfloat16)
        torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w, b), rtol=2e-2, atol=6e-2)
        head(x)
    kernel_rows = [1, 3] if max_rows == 3 else [1, 3, 4, 9]
    assert calls == [r for m in (1, 3, 4, 9) for r in ([m, m] if m in kernel_rows else [m])]


def _pool(num_kv_heads, num_blocks, block_size, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))


def _tables(lens, block_size, num_blocks, seed):
    """Each sequence gets distinct, shuffled blocks (1.. : 0 pads), width of the longest."""
    gen = torch.Generator().manual_seed(seed)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(-(-n // block_size) for n in lens)
    rows, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        rows.append(order[used:used + nb] + [0] * (width - nb))
        used += nb
    return torch.tensor(rows, dtype=torch.long)


def _torch_path(q, k_cache, v_cache, tables, lens, block_size, scale):
    meta = attention.AttentionMetadata(torch.empty(0, dtype=torch.long), torch.arange(len(lens)),
                                       tables, lens, block_size)
    available = kernels._state.get("ok")
    kernels._state["ok"] = False
    try:
        return attention._decode(q, k_cache, v_cache, meta, attention.AttentionKind(scale))
    finally:
        kernels._state["ok"] = available


# (H, Hkv): GQA 7:1 of the small preset (14:2, and its tp=2 shard 7:1), 2:1 of tiny, MHA, 8:1.
HEADS = [(14, 2), (7, 1), (4, 2), (2, 1), (4, 4), (8, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_attention_matches_torch_path(dtype, heads, head_dim):
    num_heads, num_kv_heads = heads
    block_size, num_blocks = 16, 64
    lens = torch.tensor([1, 15, 16, 17, 31, 32, 33, 100, 250], dtype=torch.long)
    k_cache, v_cache = _pool(num_kv_heads, num_blocks, block_size, head_dim, dtype, head_dim)
    tables = _tables(lens.tolist(), block_size, num_blocks, seed=num_heads)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    ref = _torch_path(q, k_cache, v_cache, tables, lens, block_size, scale)
    assert out.shape == q.shape and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_decode_attention_block_sizes_and_strided_q(block_size):
    lens = torch.tensor([3, block_size, block_size + 1, 5 * block_size - 1], dtype=torch.long)
    k_cache, v_cache = _pool(2, 40, block_size, 64, torch.float32, block_size)
    tables = _tables(lens.tolist(), block_size, 40, seed=block_size)
    qkv = torch.randn(len(lens), 3, 14, 64)  # q as a strided view, as in the model
    q = qkv[:, 0]
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    ref = _torch_path(q, k_cache, v_cache, tables, lens, block_size, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_large_scores_are_stable():
    """Scores far apart (one key dominates): exp underflows to 0, never NaN."""
    k_cache, v_cache = _pool(1, 8, 16, 32, torch.float32, 0)
    lens = torch.tensor([40], dtype=torch.long)
    tables = _tables([40], 16, 8, seed=0)
    q = torch.randn(1, 2, 32) * 100
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    ref = _torch_path(q, k_cache, v_cache, tables, lens, 16, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
