"""Weighted fair queuing among tenants: start-time fair queuing over token costs.

    push(tenant, item, cost) ──tags──> one FIFO per tenant
    peek() / pop() ──> the head with the smallest finish tag (ties: pushed first)

Each item gets a start tag S = max(V, F_prev) and a finish tag
F = S + cost / weight, where F_prev is the finish tag of its tenant's
previous item and V the virtual time: the start tag of the item popped
last. A tenant that sends more than its share runs ahead in virtual time and
waits; one that was idle restarts at V (it banks no credit for idling), so a
light tenant's request comes out after at most its own weighted cost's
worth of each other tenant's items, however deep their queues. Over a busy period each tenant gets
cost served in proportion to its weight.

cost is in tokens (prompt + max_tokens: what the request asks of an engine),
so a tenant of long prompts does not out-consume one of short ones by
request count. An item removed before it is popped (an aborted request)
leaves its tenant's later tags as they were: that tenant waits a little
longer, nobody else does. Pure Python, no I/O; ties are deterministic.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Tagged(Generic[T]):
    start: float
    finish: float
    seq: int  # push order: the tie-break
    tenant: str
    item: T


class FairQueue(Generic[T]):
    """weight_of(tenant) -> its weight (> 0)."""

    def __init__(self, weight_of: Callable[[str], float]):
        self.weight_of = weight_of
        self.vtime = 0.0
        self._queues: dict[str, deque[Tagged[T]]] = {}
        self._last_finish: dict[str, float] = {}  # of tenants with an item queued or recent
        self._num_pushed = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __iter__(self) -> Iterator[Tagged[T]]:
        for q in self._queues.values():
            yield from q

    def num_queued(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def push(self, tenant: str, item: T, cost: float) -> Tagged[T]:
        start = max(self.vtime, self._last_finish.get(tenant, 0.0))
        tagged = Tagged(start, start + max(cost, 1.0) / self.weight_of(tenant),
                        self._num_pushed, tenant, item)
        self._num_pushed += 1
        self._last_finish[tenant] = tagged.finish
        self._queues.setdefault(tenant, deque()).append(tagged)
        return tagged

    def peek(self) -> Tagged[T] | None:
        """The next item in fair order, left queued."""
        heads = [q[0] for q in self._queues.values()]
        return min(heads, key=lambda t: (t.finish, t.seq)) if heads else None

    def pop(self) -> Tagged[T] | None:
        head = self.peek()
        if head is None:
            return None
        queue = self._queues[head.tenant]
        queue.popleft()
        if not queue:
            del self._queues[head.tenant]
        self.vtime = max(self.vtime, head.start)
        self._forget_idle()
        return head

    def remove(self, match: Callable[[T], bool]) -> list[Tagged[T]]:
        """Take out every queued item match() holds for (aborted requests)."""
        removed = []
        for tenant in list(self._queues):
            kept = deque(t for t in self._queues[tenant] if not match(t.item))
            removed += [t for t in self._queues[tenant] if match(t.item)]
            if kept:
                self._queues[tenant] = kept
            else:
                del self._queues[tenant]
        return removed

    def _forget_idle(self) -> None:
        """A tenant with nothing queued whose last finish tag V has passed
        would restart at V anyway: dropping it bounds the memory by the
        tenants queued (or just served)."""
        if len(self._last_finish) > 2 * len(self._queues) + 64:
            self._last_finish = {t: f for t, f in self._last_finish.items()
                                 if t in self._queues or f > self.vtime}
