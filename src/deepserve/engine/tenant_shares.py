"""Tenants sharing one step of a TE by weight (the scheduler's, engine/scheduler.py).

    weighted_order(seqs)   the sequences interleaved among their tenants: next
                           comes the tenant with the fewest taken per unit of
                           weight (each tenant's own in the order given)
    TenantShares(seqs, n)  n tokens split among their tenants weighted max-min
                           (water-filling): a tenant that needs less than its
                           share gets what it needs, the others split the rest
                           by weight, so nothing is left that one could use

A tenant's weight is its [tenants] weight (config/tenants.py), which the job
executor sends with each request (SubmitRequest.tenant_weight). Sequences
without a tenant are one tenant; one tenant alone is scheduled as before.
"""

from __future__ import annotations

import heapq
from collections import Counter

from deepserve.engine.sequence import Sequence


def weighted_order(seqs: list[Sequence]) -> list[Sequence]:
    """seqs interleaved among their tenants by weight (each tenant's in the order
    given): next comes the tenant with the fewest taken per unit of its weight,
    ties to the earlier sequence. One tenant: seqs as they are."""
    queues: dict[str | None, list[Sequence]] = {}
    for seq in seqs:
        queues.setdefault(seq.tenant, []).append(seq)
    if len(queues) < 2:
        return list(seqs)
    heap = [(1 / q[0].tenant_weight, q[0].seq_id, t) for t, q in queues.items()]
    heapq.heapify(heap)
    taken = dict.fromkeys(queues, 0)
    out = []
    while heap:
        _, _, tenant = heapq.heappop(heap)
        queue = queues[tenant]
        out.append(queue[taken[tenant]])
        taken[tenant] += 1
        if taken[tenant] < len(queue):
            heapq.heappush(heap, ((taken[tenant] + 1) / queue[0].tenant_weight,
                                  queue[taken[tenant]].seq_id, tenant))
    return out


class TenantShares:
    """A step's tokens among the tenants of some sequences, by weight and
    work-conserving (weighted max-min, water-filling): a tenant that needs less
    than its weighted share gets what it needs, the others split the rest by
    weight. cap(seq, budget) is what seq may take now; spend(seq, n) books what
    it took. One tenant: the whole budget."""

    def __init__(self, seqs: list[Sequence], budget: int, need=lambda s: s.num_uncomputed_tokens):
        weight = {s.tenant: s.tenant_weight for s in seqs}
        self.alloc: dict[str | None, int] | None = None
        if len(weight) > 1:
            demand = Counter()
            for seq in seqs:
                demand[seq.tenant] += max(0, need(seq))
            self.alloc = _water_fill(demand, weight, budget)

    def cap(self, seq: Sequence, budget: int) -> int:
        if self.alloc is None or seq.tenant not in self.alloc:
            return budget
        return min(budget, self.alloc[seq.tenant])

    def spend(self, seq: Sequence, num_tokens: int) -> None:
        if self.alloc is not None and seq.tenant in self.alloc:
            self.alloc[seq.tenant] = max(0, self.alloc[seq.tenant] - num_tokens)


def _water_fill(demand: Counter, weight: dict, budget: int) -> dict:
    """Tokens per tenant: each gets min(its demand, its weighted share), the
    share computed again among the unsatisfied each time one is satisfied;
    the rounding's remainder goes one token each in the order given."""
    alloc = dict.fromkeys(demand, 0)
    active = [t for t in demand if demand[t] > 0]
    left = budget
    while active and left > 0:
        total = sum(weight[t] for t in active)
        satisfied = [t for t in active if demand[t] - alloc[t] <= left * weight[t] / total]
        if not satisfied:
            gives = {t: int(left * weight[t] / total) for t in active}
            for t in active:
                alloc[t] += gives[t]
            for t in active[:left - sum(gives.values())]:
                alloc[t] += 1
            break
        for t in satisfied:
            left -= demand[t] - alloc[t]
            alloc[t] = demand[t]
        active = [t for t in active if t not in satisfied]
    return alloc
