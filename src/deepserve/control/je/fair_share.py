"""The job executor's tenants: their limits, the TEs' slots, and a fair queue per model.

    JE._submit   ──admit(msg, tokens)──> past a tenant limit: RequestFailed rate_limited (429)
    JE._dispatch ──full_tes(tenant)──> route only among TEs with a slot free for it
                 └─ every TE of its model full (or others wait) ──wait()──> FairQueue
    JE.step      ──release(send)──> the fair queue's head, while send() finds a slot
    TaskDone / TEReport.finished / TE gone ──give(request)──> a slot frees
    a request ends at the JE (any way) ──forget(request_id)──> its tenant's counts drop

A TE runs at most max_num_seqs requests at once (TEInfo; 0: unbounded):
the JE sends it no more, so what waits, waits here, where the order is the
tenants' fair order (fair_queue.py), not in the TE's first-come queue where
a flood would sit ahead of everyone. A waiting request is bound to no TE:
when a TE dies the queue does not care; when its model has no TE left the
request goes to the JE's parking (then engine_dead) like any other.

A free slot for the others: fair order alone does not help a light tenant
whose request arrives while a flood holds every slot; it waits for one of
the flood's requests to end (no preemption). So while other tenants were
heard from in the last RESERVE_S, a tenant holding its equal share of the
slots or more (slots / tenants heard from) leaves one slot free for each of
them: the flood runs on the rest, the light tenant's request finds a slot
at once. Alone, a tenant uses every slot.

The JE learns a request ended from its TE's tokenizer (TaskDone, sent to
SubmitRequest.done_to the moment it ends), backed by the TE's next TEReport
(finished) and by the TE leaving the TE list, whichever comes first; each
frees the slot once (give() pops it once). Only TaskDone or the TE leaving
ends the task itself (job_executor.py).

Limits (config/tenants.py): a tenant's sub-requests admitted and not ended
(queued, parked or running), and their tokens (prompt + max_tokens), at
most max_requests / max_tokens; exactly at the limit is admitted, one past
it refused. A resumed attempt (attempt > 0) is never refused: it was
admitted once already. Pure Python, no I/O.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

from deepserve.config.tenants import TenantsSection
from deepserve.control.je.fair_queue import FairQueue
from deepserve.messages.control import TEInfo
from deepserve.messages.engine import RequestFailed, SubmitRequest

DEFAULT_TENANT = "default"
RESERVE_S = 10.0
"""A tenant heard from (a request admitted) this recently keeps a slot free."""

Send = Callable[[SubmitRequest, list[int], float, float], bool]
"""(msg, ids, park_until, queued_s) -> False: every TE is still full (it stays queued)."""


@dataclass(frozen=True)
class Waiting:
    msg: SubmitRequest
    ids: list[int]
    park_until: float
    since: float


def tenant_of(msg: SubmitRequest) -> str:
    return msg.tenant or msg.salt or DEFAULT_TENANT


def num_tokens(msg: SubmitRequest, ids: list[int], max_len: int | None = None) -> int:
    """What a request asks of an engine: its prompt tokens + max_tokens. An
    unset max_tokens (the TE resolves it) may take the rest of the model's
    context, max_len (when unknown: the prompt alone is counted)."""
    if msg.sampling.max_tokens is not None:
        return len(ids) + msg.sampling.max_tokens
    return max(len(ids) + 1, max_len or 0)


class FairShare:
    def __init__(self, tenants: TenantsSection = TenantsSection(),
                 clock: Callable[[], float] = time.monotonic):
        self.tenants, self.clock = tenants, clock
        self.capacity: dict[str, int] = {}  # listed TE -> max_num_seqs (bounded ones only)
        self.used: Counter[str] = Counter()  # TE -> tasks the JE has running on it
        self.slots: dict[str, tuple[str, str]] = {}  # request -> (its TE, its tenant)
        self.slots_by_tenant: Counter[str] = Counter()
        self.heard: dict[str, float] = {}  # tenant -> when its last request was admitted
        self.queues: dict[str | None, FairQueue[Waiting]] = {}  # per model name
        self.held: dict[str, tuple[str, int]] = {}  # admitted request -> (tenant, tokens)
        self.num_requests: Counter[str] = Counter()  # per tenant: admitted, not ended
        self.num_tokens: Counter[str] = Counter()
        self.num_refused: Counter[str] = Counter()

    def __bool__(self) -> bool:
        """Something waits in a fair queue."""
        return any(self.queues.values())

    def weight(self, tenant: str) -> float:
        return self.tenants.limits(tenant).weight

    # -- limits --------------------------------------------------------------
    def admit(self, msg: SubmitRequest, tokens: int) -> RequestFailed | None:
        """Count the request against its tenant; a RequestFailed (rate_limited)
        when that takes the tenant past one of its limits."""
        tenant = tenant_of(msg)
        limits = self.tenants.limits(tenant)
        over = None
        if limits.max_requests and self.num_requests[tenant] + 1 > limits.max_requests:
            over = f"{self.num_requests[tenant]} requests in flight (max_requests " \
                   f"{limits.max_requests})"
        elif limits.max_tokens and self.num_tokens[tenant] + tokens > limits.max_tokens:
            over = f"{self.num_tokens[tenant]} tokens in flight and this request asks " \
                   f"{tokens} (max_tokens {limits.max_tokens})"
        if over is not None and not msg.attempt:
            self.num_refused[tenant] += 1
            return RequestFailed(request_id=msg.request_id, error="rate_limited",
                                 message=f"Tenant {tenant!r} has {over}; retry later.",
                                 retry_after_s=self.tenants.retry_after_s)
        self.forget(msg.request_id)  # a resumed attempt replaces the one before
        self.heard[tenant] = now = self.clock()
        if len(self.heard) > 64:  # bounded by the tenants heard from lately
            self.heard = {t: at for t, at in self.heard.items() if now - at <= RESERVE_S}
        self.held[msg.request_id] = (tenant, tokens)
        self.num_requests[tenant] += 1
        self.num_tokens[tenant] += tokens
        return None

    def forget(self, request_id: str) -> None:
        """The request ended at the JE (finished, failed, aborted): it counts no more."""
        held = self.held.pop(request_id, None)
        if held is None:
            return
        tenant, tokens = held
        self.num_requests[tenant] -= 1
        self.num_tokens[tenant] -= tokens
        if not self.num_requests[tenant]:
            del self.num_requests[tenant], self.num_tokens[tenant]

    # -- TE slots -------------------------------------------------------------
    def note_tes(self, tes: Iterable[TEInfo]) -> None:
        """A TE list came: the listed TEs' capacities; a TE that left frees its slots."""
        self.capacity = {te.te_id: te.max_num_seqs for te in tes if te.max_num_seqs > 0}
        listed = {te.te_id for te in tes}
        for te_id in [t for t in self.used if t not in listed]:
            del self.used[te_id]

    def take(self, te_id: str, request_id: str) -> None:
        self.give(request_id)  # a new attempt's slot replaces its last one
        tenant = self.held.get(request_id, (DEFAULT_TENANT, 0))[0]
        self.slots[request_id] = (te_id, tenant)
        self.used[te_id] += 1
        self.slots_by_tenant[tenant] += 1

    def give(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is None:
            return
        te_id, tenant = slot
        if self.used[te_id] > 0:  # (a TE that left took its count with it)
            self.used[te_id] -= 1
        self.slots_by_tenant[tenant] -= 1
        if not self.slots_by_tenant[tenant]:
            del self.slots_by_tenant[tenant]

    def full_tes(self, tenant: str = DEFAULT_TENANT) -> frozenset[str]:
        """The TEs `tenant` may not be sent to now: those with no free slot,
        or every bounded one when the free slots left are the others' reserve."""
        full = frozenset(t for t, cap in self.capacity.items() if self.used[t] >= cap)
        now = self.clock()
        others = sum(1 for t, at in self.heard.items() if t != tenant and now - at <= RESERVE_S)
        total = sum(self.capacity.values())
        if others and self.slots_by_tenant[tenant] >= total / (others + 1):
            free = sum(max(0, cap - self.used[t]) for t, cap in self.capacity.items())
            if free <= others:
                return frozenset(self.capacity)
        return full

    @staticmethod
    def is_saturated(full: frozenset[str], tes: Iterable[TEInfo], te_model: str | None) -> bool:
        """A TE of te_model (None: any) is listed but full: a slot may free."""
        return any(te.te_id in full for te in tes if te_model is None or te.model == te_model)

    # -- the fair queues -------------------------------------------------------
    def has_waiting(self, model: str | None) -> bool:
        return bool(self.queues.get(model))

    def wait(self, model: str | None, msg: SubmitRequest, ids: list[int],
             park_until: float) -> None:
        queue = self.queues.setdefault(model, FairQueue(self.weight))
        held = self.held.get(msg.request_id)  # admitted: its tokens are counted there
        queue.push(tenant_of(msg), Waiting(msg, ids, park_until, self.clock()),
                   held[1] if held is not None else num_tokens(msg, ids))

    def release(self, send: Send) -> None:
        """Send each model's waiting requests in fair order while send() finds a slot."""
        for model, queue in list(self.queues.items()):
            while queue:
                head = queue.peek()
                w = head.item
                if not send(w.msg, w.ids, w.park_until, self.clock() - w.since):
                    break
                queue.pop()
            if not queue:
                del self.queues[model]

    def drop(self, request_id: str) -> bool:
        """An aborted request leaves the queues; True if it was waiting."""
        removed = [t for q in self.queues.values()
                   for t in q.remove(lambda w: w.msg.request_id == request_id)]
        return bool(removed)

    def waiting_by_tenant(self) -> Counter[str]:
        return Counter(t.tenant for q in self.queues.values() for t in q)
