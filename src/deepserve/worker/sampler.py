"""Sampler: logits -> one token per row, per-request parameters.

Greedy rows take the argmax. Other rows: temperature, then top-k, then top-p
(nucleus) on the scaled logits, then a draw from the row's own generator, so a
seeded request draws the same numbers whatever else is in the batch.
Logprobs are of the model's own distribution (before temperature/top-k/top-p).

Numerically safe for every value SamplingParams.validate() accepts, because
one request must never kill the worker its batch runs on (issue 11). The rule:

- temperature < TEMPERATURE_EPSILON (1e-5, as vLLM does; 0, 1e-8, 1e-300 and
  denormals included) is greedy: exactly the argmax, the generator untouched.
  Other temperatures divide the logits (one above float32's max acts as that
  max, near uniform); where that overflows (huge logits, small T) they scale
  (logits - row max) instead, so nothing reaches +inf.
- top_p keeps the tokens whose preceding mass is below top_p, and always the
  most likely one: any top_p too small to hold it (1e-300, 5e-324, which are
  0 in float32) keeps exactly the argmax token (the first on a tie).
- top_k <= 0 or >= vocab keeps every token; k keeps the k most likely and
  any tied with the k-th (so 1 keeps the top token, or the tied top ones).
- Logits are handled in float32 whatever their dtype; NaN counts as -inf
  and +inf (a bf16 overflow) as the largest float32. A row with no finite
  logit at all (a broken model, never a request's doing) is read as all
  zeros: uniform. So a sampled token is always a valid id and has a finite
  model logprob.
- Reported logprobs are floored at LOGPROB_FLOOR (-9999.0, what the OpenAI API
  and vLLM report for a token of zero probability): never -inf or NaN, which
  JSON cannot carry. top-N lists at most min(N, vocab) pairs.
"""

from __future__ import annotations

import torch

from deepserve.messages.sampling import SamplingParams

LOGPROB_FLOOR = -9999.0
_FLOAT32_MAX = torch.finfo(torch.float32).max


def sanitize(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) any float dtype -> ((N, V) float32, argmax (N,)): no NaN or +inf,
    and at least one finite value per row. One argmax pass decides: argmax
    lands on a NaN or +inf if there is one, and on -inf only in a dead row,
    so ordinary logits come back as they are, without a copy."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    if bool(torch.isfinite(logits.gather(1, tokens.unsqueeze(1))).all()):
        return logits, tokens
    clean = torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLOAT32_MAX,
                             neginf=float("-inf"))
    clean[~torch.isfinite(clean).any(dim=-1)] = 0.0
    return clean, clean.argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> torch.Tensor:
    """logits: (N, V) -> token ids (N,) int64, each in [0, V)."""
    logits, tokens = sanitize(logits)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            scaled = _filter(logits[row], _scale(logits[row], p.temperature), p)
            probs = torch.softmax(scaled, dim=-1)
            tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens


def _scale(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """row / T with a finite max (softmax of it is then NaN-free). Plain
    division where it stays finite (bit for bit what it always was); when it
    overflows, (row - max) / T, whose values are all <= 0 with the max at 0."""
    temperature = min(temperature, _FLOAT32_MAX)  # a bigger one is inf in float32
    scaled = row / temperature
    if bool(torch.isfinite(scaled.max())):
        return scaled
    return (row - row.max()) / temperature


def _filter(row: torch.Tensor, scaled: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """row: (V,) logits, scaled: (V,) row / T -> scaled with the tokens outside
    top-k / top-p set to -inf; the most likely token always stays. The order
    is the logits' (stable): dividing by T keeps it, but a huge T can round
    distinct logits to one value, and the top must still be the argmax."""
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        order = torch.sort(row, descending=True, stable=True).indices
        probs = torch.softmax(scaled[order], dim=-1)
        # Drop a token when the mass before it already reaches top_p. top_p
        # below float32's range compares as 0, so keep the first explicitly.
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        drop[0] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scaled


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None]
                ) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row: (logprob of the sampled token, top-N (id, logprob)) or None;
    every value finite and >= LOGPROB_FLOOR."""
    rows = [i for i, n in enumerate(num_top) if n is not None]
    out: list = [None] * len(num_top)
    if not rows:
        return out
    logp = torch.log_softmax(sanitize(logits[rows])[0], dim=-1)  # (R, V)
    logp = torch.nan_to_num(logp, nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
    for r, row in enumerate(rows):
        n = min(num_top[row], logp.shape[-1])
        top = torch.topk(logp[r], n) if n else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        out[row] = (float(logp[r, tokens[row]]), pairs)
    return out
