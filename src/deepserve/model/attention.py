"""Paged attention in plain torch.

KV pool of one layer, head-major so that one head's blocks are rows of one
matrix:

    k_cache, v_cache: (Hkv, num_blocks, block_size, D)

Token at position p of a sequence lives in block `block_table[p // bs]`, row
`p % bs`; its *slot* is block * bs + row. Every step first writes the new
tokens' K/V into their slots, then gathers each sequence's context block by
block and attends over it:

  * decode (one new token per sequence): all such sequences at once. With
    the C++ kernels (model/kernels.py) one op walks each sequence's block
    table and reads K/V rows in place, no copy. The torch path gathers each
    head's blocks with one index_select (whole blocks, the fastest copy
    torch has here) into a (Hkv, B, Lmax, D) buffer, and the G = H / Hkv
    query heads of a KV head are G query rows of it, so K/V are never
    repeated;
  * prefill chunk (several new tokens): one call per sequence, causal with an
    offset when part of the context was computed earlier.

A sliding layer (`window`) masks, for a query at position p, every key at or
before p - window (Hugging Face's rule: a key counts while p - k < window);
its blocks stay in the pool, so a layer of either kind reads the same block
table. Score soft-capping (`softcap`: tanh(s / c) * c, Gemma) and windows take
the torch path; the C++ decode kernel serves plain full attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from deepserve.model import kernels


@dataclass
class PrefillSpan:
    """One sequence with several new tokens in this step.

    rows [start, start + num_new) of the flat batch are its new tokens;
    block_ids: (nb,) its blocks; ctx_len: tokens of context, the new last.
    """

    start: int
    num_new: int
    block_ids: torch.Tensor
    ctx_len: int
    _masks: dict = field(default_factory=dict, repr=False)  # window -> mask, per step

    @property
    def mask(self) -> torch.Tensor | None:
        """(num_new, ctx_len) causal mask; None when ctx_len == num_new (plain causal)."""
        return None if self.num_new == self.ctx_len else self.window_mask(None)

    def window_mask(self, window: int | None) -> torch.Tensor:
        """(num_new, ctx_len) True where new token i (at position ctx_len -
        num_new + i) sees key j: j <= it, and j within `window` of it when
        given. Built once per step and window, shared by the layers."""
        if window not in self._masks:
            query_pos = torch.arange(self.ctx_len - self.num_new, self.ctx_len).unsqueeze(1)
            keys = torch.arange(self.ctx_len)
            mask = keys <= query_pos
            if window is not None:
                mask &= keys > query_pos - window
            self._masks[window] = mask
        return self._masks[window]


@dataclass
class AttentionMetadata:
    """Built once per step, shared by every layer.

    slot_mapping: (T,) KV slot of each new token.
    decode_rows: (Bd,) rows of the decode tokens in the flat batch.
    decode_tables: (Bd, nb) int64 block ids of the decode sequences, padded.
    decode_lens: (Bd,) int64 context length of each, its new token included.
    block_size: tokens per KV block.
    is_all_decode: every row is a decode row, in order (decode_rows = arange(T)).
    """

    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    block_size: int
    prefills: list[PrefillSpan] = field(default_factory=list)
    is_all_decode: bool = False
    _window_masks: dict = field(default_factory=dict, repr=False)  # window -> decode mask

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """(1, Bd, 1, nb * bs) True where a key is in the context (torch path)."""
        keys = torch.arange(self.decode_tables.shape[1] * self.block_size)
        return (keys < self.decode_lens.unsqueeze(1)).view(1, self.num_decodes, 1, -1)

    def window_mask(self, window: int) -> torch.Tensor:
        """decode_mask less the keys a sliding layer of `window` no longer sees."""
        masks = self._window_masks
        if window not in masks:
            keys = torch.arange(self.decode_tables.shape[1] * self.block_size)
            first = (self.decode_lens - window).unsqueeze(1)  # keys <= len - 1 - window drop
            masks[window] = self.decode_mask & (keys >= first).view(1, self.num_decodes, 1, -1)
        return masks[window]


@dataclass(frozen=True)
class AttentionKind:
    """What one layer's attention is beyond causal: scale: q.k's softmax scale;
    window: a sliding window in tokens (None: full); softcap: score cap (None: off)."""

    scale: float
    window: int | None = None
    softcap: float | None = None

    @property
    def is_plain(self) -> bool:
        return self.window is None and self.softcap is None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, kind: AttentionKind) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (Hkv, NB, bs, D) -> (T, H, D)."""
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim)[:, meta.slot_mapping] = k.transpose(0, 1)
    v_cache.view(num_kv_heads, -1, head_dim)[:, meta.slot_mapping] = v.transpose(0, 1)
    if meta.is_all_decode:
        return _decode(q, k_cache, v_cache, meta, kind)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta, kind)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_new)
        out[rows] = _prefill(q[rows], k_cache, v_cache, span, kind)
    return out


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """cache: (Hkv, NB, bs, D), blocks: (B * nb,) -> (Hkv, B, nb * bs, D)."""
    num_kv_heads, _, block_size, head_dim = cache.shape
    out = cache.new_empty(num_kv_heads, blocks.numel(), block_size, head_dim)
    for h in range(num_kv_heads):
        torch.index_select(cache[h], 0, blocks, out=out[h])
    return out.view(num_kv_heads, num_seqs, -1, head_dim)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, kind: AttentionKind) -> torch.Tensor:
    """q: (B, H, D) -> (B, H, D), one query token per sequence."""
    if kind.is_plain and kernels.available() and q.dtype in (torch.bfloat16, torch.float32) \
            and q.shape[-1] in (32, 64, 128) and q.shape[1] // k_cache.shape[0] <= 8:
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables,
                                              meta.decode_lens, kind.scale)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    # (B, H, D) -> (Hkv, B, G, D): query heads of one KV head become its rows.
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    blocks = meta.decode_tables.flatten()
    keys = gather_blocks(k_cache, blocks, num_seqs)  # (Hkv, B, L, D)
    values = gather_blocks(v_cache, blocks, num_seqs)
    mask = meta.decode_mask if kind.window is None else meta.window_mask(kind.window)
    out = _attend(qg, keys, values, mask, kind)  # (Hkv, B, G, D)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             span: PrefillSpan, kind: AttentionKind) -> torch.Tensor:
    """q: (N, H, D) -> (N, H, D) for one sequence's chunk of N new tokens."""
    keys = gather_blocks(k_cache, span.block_ids, 1)[:, :, :span.ctx_len]  # (Hkv, 1, L, D)
    values = gather_blocks(v_cache, span.block_ids, 1)[:, :, :span.ctx_len]
    query = q.transpose(0, 1).unsqueeze(0)  # (1, H, N, D)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # (1, Hkv, L, D)
    if kind.is_plain:
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=span.mask, is_causal=span.mask is None,
            scale=kind.scale, enable_gqa=True)  # (1, H, N, D)
    else:
        out = _attend(query, keys, values, span.window_mask(kind.window), kind)
    return out.squeeze(0).transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            kind: AttentionKind) -> torch.Tensor:
    """Masked attention with optional score capping: q (..., Hq, N, D) over k, v
    (..., Hkv, L, D), Hq a multiple of Hkv (GQA); mask broadcasts to (.., N, L)."""
    if kind.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kind.scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * kind.scale  # (..., Hq, N, L)
    scores = torch.tanh(scores / kind.softcap) * kind.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)
