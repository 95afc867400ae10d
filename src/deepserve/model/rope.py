"""Rotary position embedding (half-split layout, as Llama/Qwen2 checkpoints use).

`llama3` scaling rescales the inverse frequencies once, at table build time:
long wavelengths are divided by `factor`, short ones kept, the band between
interpolated smoothly.
"""

from __future__ import annotations

import math

import torch

from deepserve.model.config import RopeConfig


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "llama3":
        inv = _llama3_scale(inv, rope)
    return inv  # (D/2,) float32, as HF computes it


def _llama3_scale(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.rebuild()

    def rebuild(self) -> None:
        """(Re)compute the tables, e.g. after the module was built on `meta`."""
        if self.cos.is_meta:
            return
        # Match HF numerics: float32 inverse frequencies, float32 outer product.
        inv = inv_frequencies(self.head_dim, self.rope)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv)
        emb = torch.cat([angles, angles], dim=-1)  # (P, D)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: (T, H, D), k: (T, Hkv, D), positions: (T,) -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
