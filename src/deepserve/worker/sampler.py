"""Sampler: logits -> one token per row, per-request parameters, batched.

The order is vLLM's (Hugging Face's generate() applies the same processors
in an order that gives the same logits):

  1. sanitize: float32, NaN and +inf made safe (below);
  2. SequenceTokens.process, with the per-sequence state of penalties.py:
     logit_bias, min_tokens and bad_words_ids (added biases, -inf masks),
     then the repetition penalty (HF's RepetitionPenaltyLogitsProcessor: a
     seen token's logit, prompt or output, divided by the penalty when
     positive, multiplied when negative), then the frequency and presence
     penalties (OpenAI's, over the output);
  3. greedy rows take the argmax; the others: temperature, then min_p
     (HF's MinPLogitsWarper, on the scaled logits), top-k, top-p (nucleus),
     then a draw from the row's own generator: argmax(probs / q) with q ~
     Exp(1), V numbers from the generator, exactly what torch.multinomial(
     probs, 1, generator) draws, so a seeded request draws the same numbers
     whatever else is in the batch.
Every step is one tensor operation over the batch's rows; the only loop per
row is its generator's draw (one call). Logprobs are of the model's own
distribution (before all of the above), as vLLM reports them by default.

Numerically safe for every value SamplingParams.validate() accepts, because
one request must never kill the worker its batch runs on (issue 11). The rule:

- temperature < TEMPERATURE_EPSILON (1e-5, as vLLM does; 0, 1e-8, 1e-300 and
  denormals included) is greedy: exactly the argmax, the generator untouched.
  Other temperatures divide the logits (one above float32's max acts as that
  max, near uniform); where that overflows (huge logits, small T) they scale
  (logits - row max) instead, so nothing reaches +inf.
- min_p keeps the tokens whose probability is at least min_p times the top
  one's, so always the top one.
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
- A row whose request masks every token (logit_bias, bad_words, min_tokens
  on a tiny vocabulary) raises ValueError: that request's own error, which
  fails it alone (model_runner).
- A penalized logit stays finite: the penalty is clamped to float32's normal
  range (1e-300 is 0 in float32, 1e300 inf: 0 * inf would be NaN), a logit
  it takes past float32's range is clamped to it, and a masked (-inf) logit
  stays masked; a bias (|b| <= 100) or a presence/frequency penalty moves a
  finite logit by far less than float32's range.
- The draw's 0 / 0 (a masked token whose q is 0) counts as 0, never NaN.
- Reported logprobs are floored at LOGPROB_FLOOR (-9999.0, what the OpenAI API
  and vLLM report for a token of zero probability): never -inf or NaN, which
  JSON cannot carry. top-N lists at most min(N, vocab) pairs.
"""

from __future__ import annotations

import torch

from deepserve.messages.sampling import SamplingParams
from deepserve.worker.penalties import (OutputCounts, SeenTokens, TokenRules, penalize,
                                        penalize_at, penalize_counts_at)

__all__ = ["LOGPROB_FLOOR", "SeenTokens", "SequenceTokens", "logprobs_of", "penalize",
           "sample", "sanitize", "warp"]

LOGPROB_FLOOR = -9999.0
_FLOAT32_MAX = torch.finfo(torch.float32).max
_NEG_INF = float("-inf")


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
           generators: list[torch.Generator], seen: torch.Tensor | None = None
           ) -> torch.Tensor:
    """logits: (N, V) -> token ids (N,) int64, each in [0, V). params: resolved.
    The logits are sampled as they are: the runner processed them already
    (SequenceTokens.process). seen: (N, V) bool, for a caller without a
    SequenceTokens: the repetition penalty on these tokens first."""
    logits, tokens = sanitize(logits)
    if seen is not None:
        penalties = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        logits = penalize(logits, seen, penalties)
        tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        index = torch.tensor(rows, dtype=torch.long)
        probs = torch.softmax(warp(logits[index], [params[i] for i in rows]), dim=-1)
        tokens[index] = _draw(probs, [generators[i] for i in rows])
    return tokens


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: (R, V) float32, sanitized, of sampled (not greedy) rows -> (R, V):
    divided by the temperature, the tokens outside min_p / top-k / top-p at
    -inf; the most likely token always stays. Order by probability is the
    logits' (stable): dividing by T keeps it, but a huge T can round
    distinct logits to one value, and the top must still be the argmax."""
    knobs = torch.tensor([(min(p.temperature, _FLOAT32_MAX), p.min_p, p.top_p)
                          for p in params], dtype=torch.float32)  # (R, 3)
    top_k = torch.tensor([min(p.top_k, logits.shape[-1]) for p in params], dtype=torch.long)
    scaled = _scale(logits, knobs[:, 0:1])
    min_p = knobs[:, 1:2]
    if bool((min_p > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), _NEG_INF)
    scaled = _top_k(scaled, top_k)
    return _top_p(logits, scaled, knobs[:, 2])


def _scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(R, V) / (R, 1), each row with a finite max (softmax of it is then
    NaN-free). Plain division where it stays finite (bit for bit what it
    always was); a row it overflows is (row - max) / T: all <= 0, max at 0."""
    scaled = logits / temperature
    over = ~torch.isfinite(scaled.amax(dim=-1, keepdim=True))  # (R, 1)
    if bool(over.any()):
        shifted = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
        scaled = torch.where(over, shifted, scaled)
    return scaled


def _top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Rows with 0 < k < V keep the tokens >= their k-th largest value."""
    on = (top_k > 0) & (top_k < scaled.shape[-1])  # (R,)
    if not bool(on.any()):
        return scaled
    k_max = int(top_k[on].max())
    top = torch.topk(scaled, k_max, dim=-1).values  # (R, k_max), descending
    kth = top.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))  # (R, 1)
    return scaled.masked_fill(on.unsqueeze(1) & (scaled < kth), _NEG_INF)


def _top_p(logits: torch.Tensor, scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows with top_p < 1 drop a token when the mass before it (in the
    logits' stable order) already reaches top_p. A top_p below float32's
    range compares as 0, so the first token is kept explicitly."""
    rows = (top_p < 1.0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return scaled
    order = torch.sort(logits[rows], dim=-1, descending=True, stable=True).indices  # (P, V)
    probs = torch.softmax(scaled[rows].gather(1, order), dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[rows].unsqueeze(1)
    drop[:, 0] = False
    scaled[rows] = scaled[rows].masked_fill(torch.zeros_like(drop).scatter(1, order, drop),
                                            _NEG_INF)
    return scaled


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """probs: (R, V) -> (R,): row i's token from generators[i] alone, as
    torch.multinomial(probs[i], 1, generator=generators[i]) draws it."""
    q = torch.empty(probs.shape, dtype=probs.dtype)  # on the generators' device (CPU)
    for i, gen in enumerate(generators):
        q[i].exponential_(generator=gen)
    ratio = (probs / q.to(probs.device)).nan_to_num_(nan=0.0)
    return ratio.argmax(dim=-1)


class SequenceTokens:
    """The sampling state of every sequence the runner holds, for the
    logits processors that read a sequence's tokens (penalties.py): add one
    at admission, drop it at finish, process a batch, mark what it sampled."""

    def __init__(self, vocab_size: int):
        self.seen = SeenTokens(vocab_size)  # repetition_penalty
        self.counts = OutputCounts(vocab_size)  # presence / frequency_penalty
        self.rules = TokenRules(vocab_size)  # logit_bias, min_tokens, bad_words_ids

    def add(self, seq_id: int, p: SamplingParams, token_ids: list[int],
            output_ids: list[int], stop_token_ids: list[int]) -> None:
        """token_ids: prompt and output (read with a repetition penalty);
        output_ids: the output so far; stop_token_ids: what min_tokens masks."""
        if p.has_repetition_penalty:
            self.seen.add(seq_id, token_ids)
        if p.presence_penalty or p.frequency_penalty:
            self.counts.add(seq_id, output_ids)
        if TokenRules.applies_to(p):
            self.rules.add(seq_id, p, output_ids, stop_token_ids)

    def drop(self, seq_id: int) -> None:
        self.seen.drop(seq_id)
        self.counts.drop(seq_id)
        self.rules.drop(seq_id)

    def process(self, seq_ids: list[int], params: list[SamplingParams],
                logits: torch.Tensor) -> torch.Tensor:
        """logits: (N, V) as the model made them -> (N, V) float32, sanitized,
        with the biases, masks and penalties of these rows' sequences (the
        input itself, untouched, when no sequence has any)."""
        if not (self.seen.rows or self.counts.rows or self.rules.slots):
            return logits
        clean = sanitize(logits)[0]
        out = self.rules.apply(seq_ids, clean)  # a copy if any rule applies
        if out is not clean and not bool(torch.isfinite(out.amax(dim=-1)).all()):
            raise ValueError("every token is masked (logit_bias, bad_words, min_tokens)")
        seen, counts = self.seen.nonzero(seq_ids), self.counts.nonzero(seq_ids)
        if out is clean and (seen or counts):
            out = clean.clone()  # the penalties work in place: never on the model's logits
        if seen is not None:
            penalties = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            penalize_at(out, seen[:2], penalties)
        if counts is not None:
            pf = torch.tensor([(p.presence_penalty, p.frequency_penalty) for p in params],
                              dtype=torch.float32)  # (N, 2)
            penalize_counts_at(out, counts[:2], counts[2], pf[:, 0], pf[:, 1])
        return out

    def mark(self, seq_ids: list[int], tokens: torch.Tensor) -> None:
        """These rows' sequences sampled these tokens (N,): one scatter each."""
        self.seen.mark(seq_ids, tokens)
        self.counts.mark(seq_ids, tokens)
        self.rules.mark(seq_ids, tokens)


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
