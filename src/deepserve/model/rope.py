"""Rotary position embedding (half-split layout, as Hugging Face checkpoints use).

One cos/sin table per distinct RopeConfig, indexed by absolute position,
built once at load. Each scaling changes the inverse frequencies (and yarn /
longrope also scale cos and sin by an attention factor), never the rotation:

- linear: every frequency divided by `factor`;
- dynamic (NTK): the base grows with the sequence past max_position_embeddings;
  our table stops there, where the base is still the model's own, so the
  table is the default one (what Hugging Face computes for those lengths);
- llama3: long wavelengths divided by `factor`, short ones kept, the band
  between blended;
- yarn: frequencies between the beta_fast / beta_slow rotation counts ramp
  from kept to divided by `factor`; cos/sin times 0.1 ln(factor) + 1;
- longrope (Phi-3): each frequency divided by its own short_factor below
  original_max_position_embeddings and by its long_factor from there on
  (per position: a short sequence's table is exactly the short one);
  cos/sin times sqrt(1 + ln(s) / ln(original)), s = max positions / original.

With partial rotary (partial_rotary_factor < 1) only the first rotary_dim
dims of each head turn; the rest pass through.
"""

from __future__ import annotations

import math

import torch

from deepserve.model.config import RopeConfig


def inv_frequencies(dim: int, rope: RopeConfig, max_positions: int = 0,
                    long: bool = False) -> tuple[torch.Tensor, float]:
    """(D/2,) float32 inverse frequencies and the cos/sin factor, as HF computes
    them. max_positions: the model's max_position_embeddings (yarn / longrope
    may derive their factor from it); long: longrope's long factors."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (rope.theta ** exponents)
    kind = rope.rope_type
    if kind == "linear":
        return inv / rope.factor, 1.0
    if kind == "llama3":
        return _llama3_scale(inv, rope), 1.0
    if kind == "yarn":
        return _yarn(inv, dim, rope, max_positions)
    if kind == "longrope":
        return _longrope(exponents, rope, max_positions, long)
    return inv, 1.0  # default, dynamic (see the module docstring)


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def _extension(rope: RopeConfig, max_positions: int) -> tuple[int, float]:
    """(the pretraining context, how many times longer the model's is): the
    config's factor, else max positions / original (yarn, longrope)."""
    old_len = rope.original_max_position_embeddings
    return old_len, rope.factor or max_positions / old_len


def _yarn(inv: torch.Tensor, dim: int, rope: RopeConfig,
          max_positions: int) -> tuple[torch.Tensor, float]:
    old_len, factor = _extension(rope, max_positions)
    attention = rope.attention_factor
    if attention is None:
        attention = (_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
                     if rope.mscale and rope.mscale_all_dim else _yarn_mscale(factor))

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide)
    return inv / factor * (1 - keep) + inv * keep, float(attention)


def _longrope(exponents: torch.Tensor, rope: RopeConfig, max_positions: int,
              long: bool) -> tuple[torch.Tensor, float]:
    old_len, factor = _extension(rope, max_positions)
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    return 1.0 / (ext * rope.theta ** exponents), float(attention)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position: (P, rotary_dim)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.rotary_dim = rotary_dim or head_dim
        self.register_buffer("cos", torch.empty(max_positions, self.rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, self.rotary_dim), persistent=False)
        self.rebuild()

    @property
    def is_partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def rebuild(self) -> None:
        """(Re)compute the tables, e.g. after the module was built on `meta`."""
        if self.cos.is_meta:
            return
        # Match HF numerics: float32 inverse frequencies, float32 outer product.
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        inv, factor = inv_frequencies(self.rotary_dim, self.rope, self.max_positions)
        angles = torch.outer(positions, inv)  # (P, rotary_dim / 2)
        if self.rope.rope_type == "longrope":
            start = self.rope.original_max_position_embeddings
            long_inv, _ = inv_frequencies(self.rotary_dim, self.rope, self.max_positions, True)
            angles[start:] = torch.outer(positions[start:], long_inv)
        emb = torch.cat([angles, angles], dim=-1)  # (P, rotary_dim)
        self.cos = emb.cos() * factor
        self.sin = emb.sin() * factor

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: (T, H, D), k: (T, Hkv, D), positions: (T,) -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, R)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        if self.is_partial:
            r = self.rotary_dim
            return (torch.cat([_rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1),
                    torch.cat([_rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
