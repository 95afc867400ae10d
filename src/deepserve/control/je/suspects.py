"""Requests of death: which requests were in flight when their TE crashed.

    JE._fail_tasks_of(te) ──crashed(request, te)──> SuspectBook ──> crashes so far
    JE._submit            ──is_quarantined / is_suspect──┘
    TEReport.finished     ──forget(request)──┘ (it completed: not poison)

Whatever the cause, every request in flight on a TE when that TE left the
TE list is a *suspect*: the TE may have died of it (a sampler NaN, a kernel
fault) or of something else (OOM, a drill, a bad device). The JE cannot tell
which, so the rule counts crashes per request id, each with the part of the
TE that failed (TEList.down: worker0, master, tokenizer, host; "" unknown):

    crashes                     state        the JE
    0                           -            routes it as usual
    1, or 2 of different parts  suspect      fails it as te_lost (the gateway
                                             resumes it) and runs the resumed
                                             attempt isolated (job_executor.py)
    2 of one part (or one       quarantined  fails it as request_crashed_engine
      unknown), or 3 of any                  (final: not in RETRYABLE_ERRORS), logs
                                             `request_quarantined`, and refuses
                                             the id at once if it comes back

A request of death fails the same part each time (its worker's forward, its
tokenizer's detokenize); a request caught in two unrelated faults close
together (a poison request's crash, then a killed tokenizer) is not
convicted for it: it resumes once more, and a third crash of any kind
convicts it, so a request of death whose crashes differ still costs three
restarts at most.

A resumed suspect runs *isolated* (isolation.py: Isolation.hold / release):

  - solo: never on a TE (prefill or decode) that already runs a suspect, so
    when a poison request crashes its second TE, the suspects that merely
    shared its first crash are not there to be quarantined with it;
  - with a spare: only while another TE of the job's kind (colocated; for
    a PD job any other) runs no suspect, so a poison request cannot take
    the last TE, the node, down with it, and two TEs do not restart at once.
    A suspect that finds no spare waits (FIFO; the gateway's deadline aborts
    it) and after SPARE_WAIT_S runs solo anyway (SUSPECT_HOLD_S if no spare
    was ever listed: a one-TE node must still resume);
  - back where it crashed: on a TE that already went down with it, if that
    one is up again, so a poison request's second crash hits the same TE
    and the rest of the node (running requests, caches) is never touched.

The trade-off: a poison request costs two restarts (the crash that made it
a suspect and the one that convicts it, normally of the same TE), never
more, and never the whole node. One restart would mean failing it at its first crash, and so failing
every innocent request that happened to share a TE's unrelated crash (OOM,
a kill, a device fault): at that point nothing tells the culprit from its
batch. Innocent co-located requests are resumed and complete; they pay at
most a wait for a spare and serial resumption among suspects. A fresh
request may share a TE with a suspect: if that one is poison, the fresh one
sees one crash and is resumed.

Memory is bounded: at most `capacity` request ids (the one whose last crash
is oldest dropped first) and none older than `ttl_s` since its last crash. A request
that completes is forgotten at once. Forgetting early only costs one more
resume of a poison request, never a wrong failure. Pure Python, no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

MAX_CRASHES = 2
"""Crashes of one part with one request that quarantine it (the issue: "resume
once"); MAX_CRASHES + 1 of any parts do too."""
TTL_S = 600.0
"""Seconds a request id's crashes are remembered after its last one."""
CAPACITY = 10_000
"""Request ids remembered at most (LRU)."""
SUSPECT_HOLD_S, SPARE_WAIT_S = 15.0, 120.0
"""Seconds a resumed suspect waits for a spare TE before it runs solo anyway:
SPARE_WAIT_S where the TE list once had a spare for its kind of job (one is
restarting, which may take long on a busy host), else SUSPECT_HOLD_S."""
MAX_HELD, MAX_HELD_S = 4096, 300.0
"""Suspects waiting at most, and for how long; past either the oldest fails."""


class SuspectBook:
    def __init__(self, max_crashes: int = MAX_CRASHES, ttl_s: float = TTL_S,
                 capacity: int = CAPACITY, clock: Callable[[], float] = time.monotonic):
        if max_crashes < 1 or ttl_s <= 0 or capacity < 1:
            raise ValueError("max_crashes, ttl_s and capacity must be positive, got "
                             f"{max_crashes}, {ttl_s} and {capacity}")
        self.max_crashes, self.ttl_s, self.capacity, self.clock = (max_crashes, ttl_s,
                                                                   capacity, clock)
        self._crashes: OrderedDict[str, tuple[float, list[tuple[str, str]]]] = OrderedDict()
        """request id -> (its last crash, [(TE id, part)] oldest first)."""

    def __len__(self) -> int:
        self._expire()
        return len(self._crashes)

    def crashed(self, request_id: str, te_id: str, part: str = "") -> list[str]:
        """Note that `te_id` went down with the request, `part` of it failing
        ("" unknown); the TEs of its crashes so far."""
        self._expire()
        _, crashes = self._crashes.pop(request_id, (0.0, []))
        crashes = [*crashes, (te_id, part)]  # a TE flapping back is fenced (te_links.py)
        self._crashes[request_id] = (self.clock(), crashes)
        while len(self._crashes) > self.capacity:
            self._crashes.popitem(last=False)
        return [te for te, _ in crashes]

    def _entry(self, request_id: str) -> list[tuple[str, str]]:
        self._expire()
        entry = self._crashes.get(request_id)
        return list(entry[1]) if entry is not None else []

    def crashes(self, request_id: str) -> list[str]:
        """The TEs that went down with the request (oldest first), if remembered."""
        return [te for te, _ in self._entry(request_id)]

    def parts(self, request_id: str) -> list[str]:
        """The parts that failed in its crashes (oldest first; "" unknown)."""
        return [part for _, part in self._entry(request_id)]

    def is_suspect(self, request_id: str) -> bool:
        return bool(self._entry(request_id)) and not self.is_quarantined(request_id)

    def is_quarantined(self, request_id: str) -> bool:
        parts = self.parts(request_id)
        if len(parts) > self.max_crashes:
            return True
        if "" in parts:  # not known: any part, as before parts were told
            return len(parts) >= self.max_crashes
        return any(parts.count(p) >= self.max_crashes for p in set(parts))

    def forget(self, request_id: str) -> None:
        self._crashes.pop(request_id, None)

    def _expire(self) -> None:
        oldest = self.clock() - self.ttl_s
        while self._crashes:
            request_id, (t, _) = next(iter(self._crashes.items()))
            if t > oldest:
                break
            del self._crashes[request_id]


@dataclass
class Held:
    msg: Any  # the resumed SubmitRequest
    ids: list[int]  # its prompt, tokenized once
    since: float


class HeldSuspects:
    """Resumed suspects waiting to run isolated, oldest first; bounded in
    number (add returns the oldest it pushed out) and in time (`due` hands
    out the expired ones to fail)."""

    def __init__(self, hold_s: float = SUSPECT_HOLD_S, max_held: int = MAX_HELD,
                 max_wait_s: float = MAX_HELD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s, self.max_held, self.max_wait_s, self.clock = (hold_s, max_held,
                                                                   max_wait_s, clock)
        self._held: list[Held] = []
        self.most_listed = {"colocated": 0, "disaggregated": 0}  # TEs a job of each kind saw

    def note_listed(self, te_types: list[str]) -> None:
        """A TE list: the most TEs each kind of job ever had to choose from."""
        counts = {"colocated": te_types.count("colocated"), "disaggregated": len(te_types)}
        for kind, n in counts.items():
            self.most_listed[kind] = max(self.most_listed[kind], n)

    def __len__(self) -> int:
        return len(self._held)

    def add(self, msg, ids: list[int]) -> Held | None:
        self._held.append(Held(msg, ids, self.clock()))
        return self._held.pop(0) if len(self._held) > self.max_held else None

    def drop(self, request_id: str) -> None:
        self._held = [h for h in self._held if h.msg.request_id != request_id]

    def remove(self, held: Held) -> None:
        self._held.remove(held)

    def due(self, layout: Callable[[list[int]], str]) -> Iterator[tuple[Held, bool, bool]]:
        """(held, is_expired, needs_spare) oldest first; layout(ids): the job's
        kind, colocated or disaggregated. The caller removes what it sends or fails."""
        now = self.clock()
        for held in list(self._held):
            kind = layout(held.ids)
            had_spare = self.most_listed.get(kind, 0) >= (2 if kind == "colocated" else 3)
            waited = now - held.since
            yield held, waited > self.max_wait_s, waited < (SPARE_WAIT_S if had_spare
                                                            else self.hold_s)
