"""The global prompt tree of DeepServe's locality routing: which KV blocks
each TE holds, kept from the TEs' reports (Algorithm 1, step 2).

    TEReport.inserted / evicted ──apply──> per TE: confirmed block hashes
    Router.decide ──note_routed──> per TE: optimistic hashes (until reported / expired)
    Router._by_locality ──match(te, prompt hashes)──> leading blocks held

Pure Python, no I/O; the clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Callable, Iterable, Sequence


class GlobalPromptIndex:
    """Which KV blocks each TE holds, as sets of chained block hashes.

    Because a block's hash chains every block before it (cache/block_hash.py),
    "TE t holds the first k blocks of a prompt" is "the first k hashes of the
    prompt are all in t's set": the per-TE sets are the global prompt tree.

    Two kinds of entries per TE:
      confirmed   reported by the TE (TEReport.inserted), until evicted
      optimistic  noted when a prompt is routed there, so that a burst of
                  equal prefixes sticks to one TE before its next report;
                  promoted when reported, dropped after `optimistic_ttl_s`
                  (the request may have been aborted before its prefill)
    Memory bound: at most `max_hashes_per_te` entries per TE (8-byte ints in
    dicts, ~100 B each: the default 262144 is ~25 MiB per TE, 4 M tokens at
    block size 16). Past it the oldest optimistic entries go first, then the
    oldest confirmed ones; a dropped entry only costs a missed locality hint.
    """

    def __init__(self, max_hashes_per_te: int = 1 << 18, optimistic_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_hashes_per_te < 1:
            raise ValueError(f"max_hashes_per_te must be >= 1, got {max_hashes_per_te}")
        self.max_hashes_per_te = max_hashes_per_te
        self.optimistic_ttl_s = optimistic_ttl_s
        self.clock = clock
        self._confirmed: dict[str, OrderedDict[int, None]] = {}
        self._optimistic: dict[str, OrderedDict[int, float]] = {}  # hash -> time noted

    def add_te(self, te_id: str) -> None:
        self._confirmed.setdefault(te_id, OrderedDict())
        self._optimistic.setdefault(te_id, OrderedDict())

    def remove_te(self, te_id: str) -> None:
        self._confirmed.pop(te_id, None)
        self._optimistic.pop(te_id, None)

    def has_te(self, te_id: str) -> bool:
        return te_id in self._confirmed

    def num_hashes(self, te_id: str) -> int:
        return len(self._confirmed[te_id]) + len(self._optimistic[te_id])

    def apply(self, te_id: str, inserted: Iterable[int], evicted: Iterable[int]) -> None:
        """Cache events of one report. Unknown TEs are ignored (a report can
        overtake the TE list). In one TE's tree a hash alternates inserted /
        evicted, so (#inserted - #evicted) of a hash within one report says
        its state: +1 held, -1 gone, 0 as before."""
        if te_id not in self._confirmed:
            return
        confirmed, optimistic = self._confirmed[te_id], self._optimistic[te_id]
        net = Counter(inserted)
        net.subtract(evicted)
        for h, n in net.items():
            if n > 0:
                optimistic.pop(h, None)
                confirmed[h] = None
                confirmed.move_to_end(h)
            elif n < 0:
                optimistic.pop(h, None)
                confirmed.pop(h, None)
        self._bound(te_id)

    def note_routed(self, te_id: str, hashes: Sequence[int]) -> None:
        """Assume the TE will hold these blocks once it prefills the prompt."""
        if te_id not in self._confirmed:
            return
        confirmed, optimistic = self._confirmed[te_id], self._optimistic[te_id]
        now = self.clock()
        for h in hashes:
            if h in confirmed:
                confirmed.move_to_end(h)
            else:
                optimistic[h] = now
                optimistic.move_to_end(h)
        self._bound(te_id)

    def match(self, te_id: str, hashes: Sequence[int]) -> int:
        """Number of leading hashes the TE holds (confirmed or optimistic)."""
        if te_id not in self._confirmed:
            return 0
        self._expire(te_id)
        confirmed, optimistic = self._confirmed[te_id], self._optimistic[te_id]
        for i, h in enumerate(hashes):
            if h not in confirmed and h not in optimistic:
                return i
        return len(hashes)

    def _expire(self, te_id: str) -> None:
        optimistic = self._optimistic[te_id]
        deadline = self.clock() - self.optimistic_ttl_s
        while optimistic:  # oldest first: insertion order is time order
            h, noted = next(iter(optimistic.items()))
            if noted > deadline:
                break
            optimistic.popitem(last=False)

    def _bound(self, te_id: str) -> None:
        confirmed, optimistic = self._confirmed[te_id], self._optimistic[te_id]
        excess = len(confirmed) + len(optimistic) - self.max_hashes_per_te
        while excess > 0 and optimistic:
            optimistic.popitem(last=False)
            excess -= 1
        while excess > 0:
            confirmed.popitem(last=False)
            excess -= 1
