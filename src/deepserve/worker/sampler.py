"""Sampler: logits -> one token per row, per-request parameters.

Greedy rows take the argmax. Other rows: temperature, then top-k, then top-p
(nucleus) on the scaled logits, then a draw from the row's own generator, so a
seeded request draws the same numbers whatever else is in the batch.
Logprobs are of the model's own distribution (before temperature/top-k/top-p).
"""

from __future__ import annotations

import torch

from deepserve.messages.sampling import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> torch.Tensor:
    """logits: (N, V) float32 -> token ids (N,) int64."""
    tokens = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            probs = torch.softmax(_filter(logits[row] / p.temperature, p), dim=-1)
            tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens


def _filter(scaled: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """scaled: (V,) -> (V,) with the tokens outside top-k / top-p set to -inf."""
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the
        # most likely token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scaled


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None]
                ) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row: (logprob of the sampled token, top-N (id, logprob)) or None."""
    rows = [i for i, n in enumerate(num_top) if n is not None]
    out: list = [None] * len(num_top)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows], dim=-1)  # (R, V)
    for r, row in enumerate(rows):
        top = torch.topk(logp[r], num_top[row]) if num_top[row] else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        out[row] = (float(logp[r, tokens[row]]), pairs)
    return out
