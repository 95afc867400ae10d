"""The per-sequence token state the sampler's logits processors read, pooled
(sampler.SequenceTokens puts the three kinds together for the ModelRunner).

One row (or slot) per sequence that needs it, so a step reads its batch's
state with one gather, changes only the logits a rule touches (the nonzero
cells of the gathered rows: a few hundred per row, not V) and records the
tokens it sampled with one scatter, whatever the batch holds: no Python
loop over rows or tokens per step (only per-row dictionary lookups; the
loops run at admission and finish).

    repetition_penalty      SeenTokens:   (rows, V) bool, prompt and output
    presence / frequency    OutputCounts: (rows, V) int32, output only
    logit_bias, min_tokens, TokenRules:   sparse entries, matched against
      bad_words_ids                       each slot's output count and tail

A sequence that reaches the workers with output already (a PD decode task
holds the prefill TE's first token) is seeded from NewSeq.output_ids. A
resumed attempt's earlier output is inside its prompt (nothing on the wire
says how much of it): presence/frequency and bad words do not see it, and
min_tokens counts from the resumption; repetition_penalty sees it as prompt.

The rules, as vLLM and Hugging Face apply them (sampler.py has the order):
- logit_bias adds its bias (a float32 add, HF's SequenceBiasLogitsProcessor).
- min_tokens masks (-inf) NewSeq.stop_token_ids (EOS unless ignore_eos, and
  the request's stop_token_ids) while fewer output tokens exist.
- bad_words_ids, vLLM's rule: a 1-token word is always masked; a longer one's
  last token is masked when the OUTPUT so far ends with the tokens before it
  (vLLM reads output tokens only; HF's NoBadWordsLogitsProcessor reads the
  prompt too, so they differ only where a word would start in the prompt).
- presence/frequency (OpenAI, vLLM): logit -= frequency * count + presence
  * (count > 0), over the output. Finite logits stay finite (|change| <= 2
  + 2 * count, far inside float32's range) and masked ones (-inf) stay masked.
"""

from __future__ import annotations

import torch

from deepserve.messages.sampling import SamplingParams

_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32
ANY = -2  # a prefix column that matches any token (left of a short prefix)
NONE = -1  # a tail column before the sequence's first output token


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor
             ) -> torch.Tensor:
    """logits: (N, V) float32, sanitized; seen: (N, V) bool; penalties: (N,)
    -> (N, V), a copy: HF's repetition penalty on the seen tokens (sampler.py's
    module doc); a penalty of 1 leaves its row as it was, bit for bit."""
    out = logits.clone()
    penalize_at(out, seen.nonzero(as_tuple=True), penalties)
    return out


def penalize_at(out: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor],
                penalties: torch.Tensor) -> None:
    """In place, on the (row, token) pairs `at` only ((K,) each): what
    penalize does, without touching the other logits."""
    rows, tokens = at
    x = out[rows, tokens]  # (K,)
    # A penalty past float32's range would make 0 * inf or 0 / 0 (NaN).
    p = penalties.clamp(_FLOAT32_TINY, _FLOAT32_MAX)[rows]
    penalized = torch.where(x < 0, x * p, x / p).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX)
    out[rows, tokens] = torch.where(torch.isfinite(x), penalized, x)


def penalize_counts_at(out: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor],
                       counts: torch.Tensor, presence: torch.Tensor,
                       frequency: torch.Tensor) -> None:
    """In place: logit -= frequency * count, then -= presence, on the pairs
    `at` whose counts ((K,), > 0) these are; presence, frequency: (N,).
    Bit for bit the dense rule (x - f * 0 - p * 0 is x) on fewer values."""
    rows, tokens = at
    x = out[rows, tokens] - frequency[rows] * counts.float()
    out[rows, tokens] = x - presence[rows]


class TokenRows:
    """One (V,) row of `dtype` per tracked sequence in one pooled (rows, V)
    tensor. Row 0 stays all zero: the row of every untracked sequence.
    Freed rows are reused; the pool doubles when it is full."""

    def __init__(self, vocab_size: int, dtype: torch.dtype):
        self.vocab_size = vocab_size
        self.pool = torch.zeros(1, vocab_size, dtype=dtype)  # (rows, V)
        self.rows: dict[int, int] = {}  # seq_id -> its row (>= 1)
        self._free: list[int] = []

    def add(self, seq_id: int, token_ids: list[int]) -> None:
        """Track a sequence that has token_ids (ids outside the vocabulary
        are ignored: check_request refused them upstream)."""
        row = self._free.pop() if self._free else self._grow()
        ids = torch.tensor(token_ids, dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        self.pool[row].zero_()
        self._record(torch.full_like(ids, row), ids)
        self.rows[seq_id] = row

    def drop(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def gather(self, seq_ids: list[int]) -> torch.Tensor | None:
        """(N, V) rows of these sequences; None when none is tracked."""
        if not self.rows:
            return None
        rows = self._rows_of(seq_ids)
        return self.pool.index_select(0, rows) if bool(rows.any()) else None

    def nonzero(self, seq_ids: list[int]) -> tuple[torch.Tensor, ...] | None:
        """The nonzero cells of these sequences' rows: (batch row, token id,
        value), (K,) each; None when none is tracked. What the penalties
        touch, a few hundred per row, not V."""
        rows = self.gather(seq_ids)
        if rows is None:
            return None
        at = rows.nonzero(as_tuple=True)
        return (*at, rows[at])

    def mark(self, seq_ids: list[int], tokens: torch.Tensor) -> None:
        """Each tracked sequence has its sampled token now (tokens: (N,))."""
        if not self.rows:
            return
        rows = self._rows_of(seq_ids)
        tracked = rows > 0
        self._record(rows[tracked], tokens[tracked])

    def _record(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """One scatter: set (bool) or count (accumulate) each (row, id)."""
        if self.pool.dtype == torch.bool:
            self.pool[rows, ids] = True
        else:
            self.pool.index_put_((rows, ids), torch.ones_like(ids, dtype=self.pool.dtype),
                                 accumulate=True)

    def _rows_of(self, seq_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.rows.get(i, 0) for i in seq_ids], dtype=torch.long)

    def _grow(self) -> int:
        """Double the pool; return one new row, keep the others free."""
        n = self.pool.shape[0]
        pool = torch.zeros(2 * n, self.vocab_size, dtype=self.pool.dtype)
        pool[:n] = self.pool
        self.pool = pool
        self._free.extend(range(2 * n - 1, n, -1))
        return n


class SeenTokens(TokenRows):
    """Which token ids each sequence with a repetition penalty has seen
    (prompt and output): a bool row each."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size, torch.bool)


class OutputCounts(TokenRows):
    """How often each output token occurred, per sequence with a presence or
    frequency penalty: an int32 row each."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size, torch.int32)


class TokenRules:
    """logit_bias, min_tokens and bad_words_ids of the sequences that set any,
    as one table of entries that one index_put applies to a whole batch.

    An entry (slot, prefix, token, value, gated) adds value to token's logit
    when the slot's output ends with prefix and, if gated, while the slot
    has fewer than its min_tokens output tokens:
        logit_bias {t: b}    (slot, (), t, b, no)
        bad word w           (slot, w[:-1], w[-1], -inf, no)
        min_tokens, stop s   (slot, (), s, -inf, yes)
    Prefixes sit right-aligned in `width` columns, ANY to their left; a
    slot's `tail` holds its last `width` output tokens, NONE before its
    first, so a prefix longer than the output never matches. The table is
    rebuilt (one cat) on the first step after a sequence came or went.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.slots: dict[int, int] = {}  # seq_id -> its slot (>= 1; 0: untracked)
        self._free: list[int] = []
        self.width = 0  # the longest prefix of any entry so far
        self.tail = torch.full((1, 0), NONE, dtype=torch.long)  # (S, width)
        self.num_output = torch.zeros(1, dtype=torch.long)  # (S,)
        self.min_tokens = torch.zeros(1, dtype=torch.long)  # (S,)
        self._entries: dict[int, tuple] = {}  # seq_id -> (prefix, token, value, gated)
        self._table: tuple | None = None  # the concatenated entries; None: stale

    @staticmethod
    def applies_to(p: SamplingParams) -> bool:
        return bool(p.logit_bias or p.min_tokens or p.bad_words_ids)

    def add(self, seq_id: int, p: SamplingParams, output_ids: list[int],
            stop_token_ids: list[int]) -> None:
        words = [w for w in p.bad_words_ids if w and all(self._in_vocab(t) for t in w)]
        entries = [((), t, float(b), False) for t, b in p.logit_bias.items() if self._in_vocab(t)]
        entries += [(tuple(w[:-1]), w[-1], float("-inf"), False) for w in words]
        if p.min_tokens > 0:
            entries += [((), t, float("-inf"), True) for t in stop_token_ids if self._in_vocab(t)]
        self._widen(max((len(e[0]) for e in entries), default=0))
        slot = self._free.pop() if self._free else self._grow()
        self.slots[seq_id] = slot
        self.num_output[slot], self.min_tokens[slot] = len(output_ids), p.min_tokens
        self.tail[slot] = NONE
        last = output_ids[len(output_ids) - self.width:] if self.width else []
        if last:
            self.tail[slot, self.width - len(last):] = torch.tensor(last, dtype=torch.long)
        prefix = torch.full((len(entries), self.width), ANY, dtype=torch.long)
        for i, (pre, _, _, _) in enumerate(entries):
            if pre:
                prefix[i, self.width - len(pre):] = torch.tensor(pre, dtype=torch.long)
        self._entries[seq_id] = (slot, prefix,
                                 torch.tensor([e[1] for e in entries], dtype=torch.long),
                                 torch.tensor([e[2] for e in entries], dtype=torch.float32),
                                 torch.tensor([e[3] for e in entries], dtype=torch.bool))
        self._table = None

    def drop(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
            del self._entries[seq_id]
            self._table = None

    def apply(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: (N, V) float32 -> (N, V), a new tensor if any entry applies."""
        if not self.slots:
            return logits
        slot, prefix, token, value, gated = self._entries_table()
        at = torch.full((self.num_output.shape[0],), -1, dtype=torch.long)  # slot -> row
        slots = self._slots_of(seq_ids)
        rows = (slots > 0).nonzero().squeeze(1)
        at[slots[rows]] = rows
        row = at[slot]  # (E,) each entry's batch row, -1 when not in this batch
        on = row >= 0
        if self.width:
            on &= ((prefix == ANY) | (prefix == self.tail[slot])).all(dim=1)
        on &= ~gated | (self.num_output[slot] < self.min_tokens[slot])
        if not bool(on.any()):
            return logits
        return logits.index_put((row[on], token[on]), value[on], accumulate=True)

    def mark(self, seq_ids: list[int], tokens: torch.Tensor) -> None:
        """Each tracked sequence has its sampled token now (tokens: (N,))."""
        if not self.slots:
            return
        slots = self._slots_of(seq_ids)
        tracked = slots > 0
        slots, tokens = slots[tracked], tokens[tracked]
        self.num_output[slots] += 1
        if self.width:
            self.tail[slots] = torch.cat([self.tail[slots, 1:], tokens.unsqueeze(1)], dim=1)

    def _entries_table(self) -> tuple:
        if self._table is None:
            parts = list(self._entries.values())
            width = self.width
            self._table = (
                torch.cat([torch.full((len(e[2]),), e[0], dtype=torch.long) for e in parts]),
                torch.cat([torch.nn.functional.pad(e[1], (width - e[1].shape[1], 0), value=ANY)
                           for e in parts]),
                *(torch.cat([e[i] for e in parts]) for i in (2, 3, 4)))
        return self._table

    def _slots_of(self, seq_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.slots.get(i, 0) for i in seq_ids], dtype=torch.long)

    def _in_vocab(self, token: int) -> bool:
        return 0 <= token < self.vocab_size

    def _widen(self, width: int) -> None:
        """Room for prefixes of `width`: older slots' tails gain NONE columns
        on the left (their own entries never look that far back)."""
        if width > self.width:
            pad = torch.full((self.tail.shape[0], width - self.width), NONE, dtype=torch.long)
            self.tail = torch.cat([pad, self.tail], dim=1)
            self.width = width

    def _grow(self) -> int:
        """Double the slots; return one new slot, keep the others free."""
        n = self.num_output.shape[0]
        self.tail = torch.cat([self.tail, torch.full_like(self.tail, NONE)])
        self.num_output = torch.cat([self.num_output, torch.zeros_like(self.num_output)])
        self.min_tokens = torch.cat([self.min_tokens, torch.zeros_like(self.min_tokens)])
        self._free.extend(range(2 * n - 1, n, -1))
        return n
