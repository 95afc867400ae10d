"""The fused elementwise kernels (csrc/elementwise.cpp) against the torch
ops they replace, on bf16 activations.

rotary and the residual add round exactly where the torch chain rounds, so
they must match it bit for bit; RMSNorm sums its squares in another order
and SiLU uses the C library's exp, so those may differ by one bf16 step in
a few elements and no more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepserve.model import kernels
from deepserve.model.config import RopeConfig
from deepserve.model.layers import RMSNorm
from deepserve.model.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
BF16 = torch.bfloat16


def _one_step(a: torch.Tensor, b: torch.Tensor) -> None:
    """Every element equal or one bf16 step apart; at most 1% of them apart."""
    diff = (a.float() - b.float()).abs()
    step = b.float().abs().clamp(min=1e-30) * 2.0 ** -7
    assert bool((diff <= step * 1.01).all()), float((diff / step).max())
    assert float((diff > 0).float().mean()) <= 0.01


@pytest.mark.parametrize("rows,size", [(1, 896), (7, 896), (33, 64), (130, 40)])
def test_add_rms_norm_matches_torch(rows, size):
    gen = torch.Generator().manual_seed(rows * size)
    norm = RMSNorm(size, 1e-6).to(BF16)
    norm.weight.data = (1 + 0.1 * torch.randn(size, generator=gen)).to(BF16)
    x = torch.randn(rows, size, generator=gen).to(BF16)
    residual = (3 * torch.randn(rows, size, generator=gen)).to(BF16)
    expect_sum = residual + x
    expect = norm(expect_sum)
    res = residual.clone()
    with torch.inference_mode():
        out = kernels.add_rms_norm(x, res, norm.weight.data, 1e-6)
    assert torch.equal(res, expect_sum)  # the add, in place, bit for bit
    _one_step(out, expect)
    with torch.inference_mode():  # no x: the norm alone, residual untouched
        alone = kernels.add_rms_norm(None, res, norm.weight.data, 1e-6)
    assert torch.equal(res, expect_sum)
    _one_step(alone, norm(expect_sum))


def test_add_rms_norm_of_a_column_slice():
    """Rows with a stride wider than the row (a view into a wider tensor)."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 96, generator=gen).to(BF16)
    weight = torch.ones(64, dtype=BF16)
    res = wide[:, :64]
    expect = RMSNorm(64, 1e-5).to(BF16)(res.clone())
    _one_step(kernels.add_rms_norm(None, res, weight, 1e-5), expect)


@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (4, 4, 32), (8, 1, 128)])
def test_rotary_matches_torch_bit_for_bit(heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads + dim)
    rope = RotaryEmbedding(dim, 4096, RopeConfig(theta=1e6))
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(BF16)
    positions = torch.tensor([0, 1, 15, 16, 17, 530, 2047, 4000, 4095])
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    eq, ek = rope(positions, q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim))
    out = qkv.clone()
    kernels.rotary(out, positions, rope.cos, rope.sin, heads, kv_heads, dim)
    oq, ok, ov = out.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert torch.equal(oq.reshape(tokens, heads, dim), eq)
    assert torch.equal(ok.reshape(tokens, kv_heads, dim), ek)
    assert torch.equal(ov, v)  # v is not rotated


def test_rotary_refuses_a_position_outside_its_table():
    rope = RotaryEmbedding(32, 64, RopeConfig(theta=1e4))
    qkv = torch.zeros(2, 3 * 32, dtype=BF16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.rotary(qkv, torch.tensor([3, 64]), rope.cos, rope.sin, 1, 1, 32)


@pytest.mark.parametrize("rows,inter", [(1, 4864), (6, 100), (40, 8)])
def test_silu_and_mul_matches_torch(rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(BF16)
    gate, up = gate_up.split(inter, dim=-1)
    _one_step(kernels.silu_and_mul(gate_up), F.silu(gate) * up)


def test_fused_ops_are_for_bf16_only():
    assert kernels.fused(torch.zeros(1, dtype=BF16))
    assert not kernels.fused(torch.zeros(1))  # fp32: the exact-parity torch path
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.silu_and_mul(torch.zeros(2, 4))
