"""Grammar state of the worker's sequences, and a batch's token mask.

One xgrammar GrammarMatcher per sequence with a grammar, made when the
sequence first reaches the worker (NewSeq) and dropped with its sampling
state. A sequence that arrives with output already (a PD decode task's first
token, a resumed attempt's tokens: StructuredOutput.num_replayed) has its
matcher accept those tokens first, so its grammar continues where the
output is, on any TE. Preemption keeps the worker's state (only KV is
recomputed), so the matcher simply carries on.

Compiling runs on a thread from the moment the sequence arrives: it overlaps
the sequence's prefill forward, and sampling waits for it only if it is not
done by then (1-20 ms for everyday schemas). Compiled grammars are cached by
spec (compile.GrammarCompiler). The first grammar a worker sees also loads
xgrammar and reads the vocabulary (about 2 s, once); the step waits for it,
beating the worker's heartbeat (compile.while_beating), rather than running
forwards beside it: on a 2-core machine a thread that runs Python beside
torch's two threads slowed every forward ~10x while it lasted (seen: the
first grammar request took 10 s that way, 3 s this way).

Per step: `mask` fills one bitmask row per grammar row of the batch (one
batched xgrammar call, on its threads) and applies them to the logits at
once; `accept` advances every matcher by its sampled token (one batched
call). A matcher that has terminated (its grammar ended: the token was EOS)
allows only EOS from then on: a step already in flight for it (which the
master discards: it stopped the sequence at that EOS), or a resumed attempt
whose replayed output ended the grammar, ends there. A token the grammar
refuses (never one sampled under the mask) is reported by `accept`: that
sequence fails (GrammarError), not the batch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from deepserve.messages.sampling import StructuredOutput


class GrammarError(ValueError):
    """A sequence's grammar cannot go on (a request error: that request fails)."""


class _Entry:
    def __init__(self, compiled: Future, replay: list[int]):
        self.compiled = compiled
        self.replay = replay
        self.matcher = None

    def ready(self, seq_id: int):
        """The matcher, made (and fed the replayed tokens) on first use."""
        if self.matcher is None:
            import xgrammar as xgr
            matcher = xgr.GrammarMatcher(self.compiled.result())
            for token in self.replay:
                if not matcher.accept_token(token):
                    raise GrammarError(f"sequence {seq_id}: its output so far does not "
                                       f"follow its grammar (token {token})")
            self.matcher, self.replay = matcher, []
        return self.matcher


class GrammarBook:
    """seq_id -> its grammar state; a no-op for batches without grammars."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]):
        self.model_dir, self.vocab_size = str(model_dir), vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._entries: dict[int, _Entry] = {}
        self._compiler = None  # made (xgrammar imported) by the first grammar
        self._pool: ThreadPoolExecutor | None = None
        self._batch = None  # xgrammar's BatchGrammarMatcher
        self._bitmask: torch.Tensor | None = None

    def add(self, seq_id: int, structured: StructuredOutput, replay: list[int]) -> None:
        """Start compiling its grammar; replay: its output so far."""
        if self._compiler is None:
            self._start()
        compiled = self._pool.submit(self._compiler.compile, structured)
        self._entries[seq_id] = _Entry(compiled, list(replay))

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def mask(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: (N, V) float32, row i of seq_ids[i]; the tokens each
        grammar row cannot take next are set to -inf, in place."""
        if not self._entries:
            return logits
        rows = [(i, self._entries[s].ready(s)) for i, s in enumerate(seq_ids)
                if s in self._entries]
        ended = [i for i, m in rows if m.is_terminated()]
        if ended:  # only EOS: the end, whatever step (in flight, resumed) asks again
            eos = torch.tensor(self.eos_token_ids, dtype=torch.long)
            kept = logits[ended][:, eos]
            kept = torch.where(torch.isfinite(kept), kept, 0.0)  # its end beats min_tokens
            logits[ended] = float("-inf")
            logits[torch.tensor(ended).unsqueeze(1), eos] = kept
        rows = [(i, m) for i, m in rows if not m.is_terminated()]
        if not rows:
            return logits
        import xgrammar as xgr
        bitmask = self._bitmask_for(len(seq_ids))
        indices = [i for i, _ in rows]
        self._batch.batch_fill_next_token_bitmask([m for _, m in rows], bitmask, indices)
        xgr.apply_token_bitmask_inplace(logits, bitmask[:len(seq_ids)].to(logits.device),
                                        vocab_size=min(self.vocab_size, logits.shape[-1]),
                                        indices=indices)
        return logits

    def accept(self, seq_ids: list[int], tokens: list[int]) -> list[int]:
        """Advance each grammar row by its sampled token; the seq ids whose
        grammar refused theirs (GrammarError for each is the caller's)."""
        pairs = [(self._entries[s].matcher, t, s) for s, t in zip(seq_ids, tokens)
                 if s in self._entries and self._entries[s].matcher is not None]
        pairs = [p for p in pairs if not p[0].is_terminated()]
        if not pairs:
            return []
        import xgrammar as xgr
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([m for m, _, _ in pairs],
                                                              [t for _, t, _ in pairs])
        return [s for (_, _, s), ok in zip(pairs, accepted) if not ok]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    beat = None  # the worker's heartbeat while the grammar engine starts, if any

    def _start(self) -> None:
        from deepserve.structured.compile import GrammarCompiler, while_beating
        self._compiler = while_beating(lambda: GrammarCompiler(
            self.model_dir, self.vocab_size, self.eos_token_ids), self.beat)
        import xgrammar as xgr
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def _bitmask_for(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask
