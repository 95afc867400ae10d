"""The global prompt tree of DeepServe's locality routing: which KV blocks
each TE holds, kept from the TEs' reports (Algorithm 1, step 2).

    TEReport.inserted / evicted ──apply──> per TE: confirmed block hashes
    Router.decide ──note_routed──> per TE: optimistic hashes (until reported / expired)
    both ──> holders: hash -> TEs holding it (the reverse index, kept exact)
    Router._by_locality ──best_matches(candidates, prompt hashes)──> longest match, tied TEs

Pure Python, no I/O; the clock is injectable for tests.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from typing import Callable, Collection, Iterable, Sequence


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
    block size 16), plus a holder set per distinct hash (~200 B, shared by
    the TEs holding it). Past the bound the oldest optimistic entries go
    first, then the oldest confirmed ones; a dropped entry only costs a
    missed locality hint.

    Invariants (check_integrity): a hash is confirmed or optimistic in a TE,
    never both; holders[h] is exactly the TEs holding h either way, and no
    holder set is empty; every TE with optimistic entries has a due time in
    the expiry heap no later than its oldest entry (each TE's optimistic
    dict is in time order), so expiry never scans TEs that have nothing due.
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
        self._holders: dict[int, set[str]] = {}  # hash -> TEs holding it (either kind)
        self._due: dict[str, float] = {}  # TE -> when its oldest optimistic entry was noted
        self._expiry: list[tuple[float, str]] = []  # heap of (due, TE); stale ones skipped

    def add_te(self, te_id: str) -> None:
        self._confirmed.setdefault(te_id, OrderedDict())
        self._optimistic.setdefault(te_id, OrderedDict())

    def remove_te(self, te_id: str) -> None:
        for entries in (self._confirmed.pop(te_id, ()), self._optimistic.pop(te_id, ())):
            for h in entries:
                self._unhold(h, te_id)
        self._due.pop(te_id, None)

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
                if optimistic.pop(h, None) is None and h not in confirmed:
                    self._hold(h, te_id)
                confirmed[h] = None
                confirmed.move_to_end(h)
            elif n < 0:
                was_optimistic = optimistic.pop(h, None) is not None
                if was_optimistic or h in confirmed:
                    confirmed.pop(h, None)
                    self._unhold(h, te_id)
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
            elif h in optimistic:
                optimistic[h] = now
                optimistic.move_to_end(h)
            else:
                optimistic[h] = now
                self._hold(h, te_id)
        self._bound(te_id)
        if optimistic and te_id not in self._due:
            self._schedule(te_id)

    def match(self, te_id: str, hashes: Sequence[int]) -> int:
        """Number of leading hashes the TE holds (confirmed or optimistic)."""
        if te_id not in self._confirmed:
            return 0
        self._expire_due()
        confirmed, optimistic = self._confirmed[te_id], self._optimistic[te_id]
        for i, h in enumerate(hashes):
            if h not in confirmed and h not in optimistic:
                return i
        return len(hashes)

    def best_matches(self, candidate_ids: Collection[str], hashes: Sequence[int]
                     ) -> tuple[int, set[str]]:
        """(the longest match among the candidates, the candidates that have
        it): max(match(te, hashes) for te in candidate_ids) and the TEs tied
        at it (all candidates when it is 0), found by walking down the
        prompt's hashes and intersecting their holders: O(blocks x holders)."""
        self._expire_due()
        holders, alive, num_blocks = self._holders, None, 0
        for h in hashes:
            held = holders.get(h)
            if held is None:
                break
            if alive is not None and alive <= held:  # all still hold it: no new set
                num_blocks += 1
                continue
            held = held.intersection(candidate_ids) if alive is None else held & alive
            if not held:
                break
            alive, num_blocks = held, num_blocks + 1
        return num_blocks, alive if alive is not None else set(candidate_ids)

    def check_integrity(self) -> None:
        """Assert the invariants of the class doc (tests call it after mutations)."""
        holders: dict[int, set[str]] = {}
        for te_id, confirmed in self._confirmed.items():
            optimistic = self._optimistic[te_id]
            assert not confirmed.keys() & optimistic.keys(), te_id
            for h in [*confirmed, *optimistic]:
                holders.setdefault(h, set()).add(te_id)
            times = list(optimistic.values())
            assert times == sorted(times), te_id
            assert not times or self._due[te_id] <= times[0], te_id
            assert not times or (self._due[te_id], te_id) in self._expiry, te_id
        assert holders == self._holders

    # -- the reverse index and optimistic expiry -------------------------------------
    def _hold(self, h: int, te_id: str) -> None:
        held = self._holders.get(h)
        if held is None:
            self._holders[h] = {te_id}
        else:
            held.add(te_id)

    def _unhold(self, h: int, te_id: str) -> None:
        held = self._holders[h]
        held.discard(te_id)
        if not held:
            del self._holders[h]

    def _schedule(self, te_id: str) -> None:
        due = next(iter(self._optimistic[te_id].values()))
        self._due[te_id] = due
        heapq.heappush(self._expiry, (due, te_id))

    def _expire_due(self) -> None:
        """Drop every optimistic entry past its TTL, visiting only the TEs due."""
        deadline = self.clock() - self.optimistic_ttl_s
        heap = self._expiry
        while heap and heap[0][0] <= deadline:
            due, te_id = heapq.heappop(heap)
            if self._due.get(te_id) != due:
                continue  # the TE was removed (or is queued again)
            del self._due[te_id]
            optimistic = self._optimistic[te_id]
            while optimistic:  # oldest first: insertion order is time order
                h, noted = next(iter(optimistic.items()))
                if noted > deadline:
                    self._schedule(te_id)
                    break
                optimistic.popitem(last=False)
                self._unhold(h, te_id)

    def _bound(self, te_id: str) -> None:
        confirmed, optimistic = self._confirmed[te_id], self._optimistic[te_id]
        excess = len(confirmed) + len(optimistic) - self.max_hashes_per_te
        while excess > 0 and optimistic:
            self._unhold(optimistic.popitem(last=False)[0], te_id)
            excess -= 1
        while excess > 0:
            self._unhold(confirmed.popitem(last=False)[0], te_id)
            excess -= 1
