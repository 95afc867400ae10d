"""Host pins: blocks kept in a tier service's host slots until a wall-clock
time, whether or not they are on disk too (pure bookkeeping; TierIndex asks
it before it evicts a host slot).

    TE: a turn that ended in tool calls, its prefill done ──TierReserve(context_id,
        expires_at, on_host)──> TierIndex.reserve ──pin──> its hashes held in host slots
    TierIndex._alloc ──holds(h)?──> a held slot is not evicted
    TierIndex.lookup ──hit(h)──> num_hits: blocks a lookup found while held
    expires_at passed (TierIndex.expire) or ContextUnpin ──unpin──> back in the LRU

An agent waits seconds for its tool's result; meanwhile other requests'
blocks push its conversation out of the device pool and then out of the LRU
host tier, and its next turn recomputes the whole prefix. A host pin keeps
that prefix one copy away. Unlike a context's pin (tier_index.py) it is
soft: when it ends, its blocks go back to the LRU as any cached block, they
are not freed. At most `budget` blocks (a share of the host slots) are
held at once, so the write-through always has room; a pin past it fails
and the turn is cached as any other.
"""

from __future__ import annotations

from collections import Counter


class HostPins:
    def __init__(self, budget: int):
        self.budget = budget  # blocks held at most
        self.pins: dict[str, tuple[list[int], float]] = {}  # id -> (hashes, expires_at)
        self.held: Counter[int] = Counter()  # hash -> pins holding it
        self.num_hits = 0  # blocks lookups found held (so far)
        self.num_refused = 0  # pins past the budget (so far)

    def pin(self, pin_id: str, hashes: list[int], expires_at: float) -> bool:
        hashes = list(dict.fromkeys(hashes))
        new = sum(1 for h in hashes if h not in self.held)
        if len(self.held) + new > self.budget:
            self.num_refused += 1
            return False  # a pin of that id before stays as it was
        self.unpin(pin_id)  # again with the same id: its newest hashes and time
        self.pins[pin_id] = (hashes, expires_at)
        self.held.update(hashes)
        return True

    def unpin(self, pin_id: str) -> None:
        entry = self.pins.pop(pin_id, None)
        if entry is None:
            return
        self.held.subtract(entry[0])
        for h in entry[0]:
            if self.held[h] <= 0:
                del self.held[h]

    def holds(self, h: int) -> bool:
        return h in self.held

    def hit(self, h: int) -> None:
        if h in self.held:
            self.num_hits += 1

    def expire(self, wall_now: float) -> None:
        for pin_id in [p for p, (_, at) in self.pins.items() if at <= wall_now]:
            self.unpin(pin_id)

    def check_integrity(self) -> None:
        want = Counter(h for hashes, _ in self.pins.values() for h in hashes)
        assert want == self.held, "held counts differ from the pins"
        assert len(self.held) <= self.budget, "host pins past their budget"
