"""Sampler: logits -> one token per row, per-request parameters.

First the repetition penalty, on the whole batch at once (Hugging Face's
RepetitionPenaltyLogitsProcessor: a logit of a token the sequence has seen,
prompt or output, is divided by the penalty when positive and multiplied when
negative; SeenTokens keeps which tokens each sequence has seen). Then greedy
rows take the argmax. Other rows: temperature, then top-k, then top-p
(nucleus) on the scaled logits, then a draw from the row's own generator, so a
seeded request draws the same numbers whatever else is in the batch.
Logprobs are of the model's own distribution (before the penalty and
temperature/top-k/top-p), as vLLM reports them by default.

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
- A penalized logit stays finite: the penalty is clamped to float32's normal
  range (1e-300 is 0 in float32, 1e300 inf: 0 * inf would be NaN), a logit
  it takes past float32's range is clamped to it, and a masked (-inf) logit
  stays masked.
- Reported logprobs are floored at LOGPROB_FLOOR (-9999.0, what the OpenAI API
  and vLLM report for a token of zero probability): never -inf or NaN, which
  JSON cannot carry. top-N lists at most min(N, vocab) pairs.
"""

from __future__ import annotations

import torch

from deepserve.messages.sampling import SamplingParams

LOGPROB_FLOOR = -9999.0
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


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
    seen: (N, V) bool, the tokens each row's sequence has seen, when a row
    has a repetition penalty (SeenTokens.gather); None: no row has."""
    logits, tokens = sanitize(logits)
    if seen is not None:
        penalties = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        logits = penalize(logits, seen, penalties)
        tokens = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            scaled = _filter(logits[row], _scale(logits[row], p.temperature), p)
            probs = torch.softmax(scaled, dim=-1)
            tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor
             ) -> torch.Tensor:
    """logits: (N, V) float32, sanitized; seen: (N, V) bool; penalties: (N,)
    -> (N, V): HF's repetition penalty on the seen tokens (module doc); a
    penalty of 1 leaves its row as it was, bit for bit."""
    # A penalty past float32's range would make 0 * inf or 0 / 0 (NaN).
    p = penalties.clamp(_FLOAT32_TINY, _FLOAT32_MAX).unsqueeze(1)  # (N, 1)
    penalized = torch.where(logits < 0, logits * p, logits / p).clamp_(-_FLOAT32_MAX,
                                                                       _FLOAT32_MAX)
    return torch.where(seen & torch.isfinite(logits), penalized, logits)


class SeenTokens:
    """Which token ids each penalized sequence has seen (prompt and output).

    One bool row per such sequence in one pooled (rows, V) tensor, so a step
    reads its batch's rows with one gather and marks the tokens it sampled
    with one scatter, however many sequences it holds. Row 0 stays all
    False: the row of every sequence without a penalty. Freed rows are
    reused; the pool doubles when it is full.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.pool = torch.zeros(1, vocab_size, dtype=torch.bool)  # (rows, V)
        self.rows: dict[int, int] = {}  # seq_id -> its row (>= 1)
        self._free: list[int] = []

    def add(self, seq_id: int, token_ids: list[int]) -> None:
        """Track a sequence that has seen token_ids (ids outside the
        vocabulary are ignored: check_request refused them upstream)."""
        row = self._free.pop() if self._free else self._grow()
        ids = torch.tensor(token_ids, dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        self.pool[row].zero_()
        self.pool[row, ids] = True
        self.rows[seq_id] = row

    def drop(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def gather(self, seq_ids: list[int]) -> torch.Tensor | None:
        """(N, V) bool rows of these sequences; None when none is tracked."""
        if not self.rows:
            return None
        rows = self._rows_of(seq_ids)
        return self.pool.index_select(0, rows) if bool(rows.any()) else None

    def mark(self, seq_ids: list[int], tokens: torch.Tensor) -> None:
        """Each tracked sequence has now seen its sampled token (tokens: (N,))."""
        if not self.rows:
            return
        rows = self._rows_of(seq_ids)
        tracked = rows > 0
        self.pool[rows[tracked], tokens[tracked]] = True

    def _rows_of(self, seq_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.rows.get(i, 0) for i in seq_ids], dtype=torch.long)

    def _grow(self) -> int:
        """Double the pool; return one new row, keep the others free."""
        n = self.pool.shape[0]
        pool = torch.zeros(2 * n, self.vocab_size, dtype=torch.bool)
        pool[:n] = self.pool
        self.pool = pool
        self._free.extend(range(2 * n - 1, n, -1))
        return n


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
