"""Paged attention in plain torch.

The KV pool of one layer is a tensor of slots: (num_blocks * block_size,
Hkv, D); a token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Every step
first writes the new tokens' K/V into their slots, then gathers each
sequence's whole context through its slots and attends over it.

Sequences with one new token (decode) are attended together in one batched
call, padded to the longest context and masked; sequences with several new
tokens (a prefill chunk) get one call each, causal with an offset when part of
the context was computed earlier (prefix-cache hit or an earlier chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence with several new tokens in this step.

    rows: its new tokens are rows [start, start + num_new) of the flat batch;
    ctx_slots: (L,) slots of the whole context, the new tokens last;
    mask: (num_new, L) bool, True where attended; None when L == num_new
    (plain causal).
    """

    start: int
    num_new: int
    ctx_slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Built once per step, shared by every layer.

    slot_mapping: (T,) KV slot of each new token.
    decode_rows: (Bd,) rows of the decode tokens in the flat batch.
    decode_slots: (Bd, Lmax) context slots of each decode sequence, padded.
    decode_mask: (Bd, 1, 1, Lmax) True where attended; None if no padding.
    """

    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (S, Hkv, D) -> (T, H, D)."""
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_new)
        out[rows] = _prefill(q[rows], k_cache, v_cache, span, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (B, H, D) -> (B, H, D); one query per sequence.

    The G = H / Hkv query heads that share a KV head become G query rows of
    that head, so K/V are never repeated: (B, Hkv, G, D) x (B, Hkv, L, D).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = k_cache[meta.decode_slots].transpose(1, 2)  # (B, Hkv, L, D)
    values = v_cache[meta.decode_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask,
                                         scale=scale)  # (B, Hkv, G, D)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             span: PrefillSpan, scale: float) -> torch.Tensor:
    """q: (N, H, D) -> (N, H, D) for one sequence's chunk of N new tokens."""
    keys = k_cache[span.ctx_slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
    values = v_cache[span.ctx_slots].transpose(0, 1).unsqueeze(0)
    query = q.transpose(0, 1).unsqueeze(0)  # (1, H, N, D)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=span.mask, is_causal=span.mask is None,
        scale=scale, enable_gqa=True)  # (1, H, N, D)
    return out.squeeze(0).transpose(0, 1)
