"""Resumed suspects run isolated (the job executor's Isolation; the rules and
their trade-off: suspects.py).

    JE._submit ──hold(suspect, ids, tasks)──> HeldSuspects (oldest first)
    JE.step    ──release(tasks)──> route(exclude) ──send(is_suspect)──> a TE
                                └──fail──> past its wait (engine_dead)

A request in flight on a TE that crashed resumes, with [router]
isolate_suspects, only where it cannot take a second TE down with another
suspect: never beside another suspect, only while another TE of its kind
stays free of suspects, and back on the TE it crashed once that one is up.
The JE's tasks say which TEs run a suspect; they are passed in per call.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping

from deepserve.control.je.suspects import HeldSuspects, SuspectBook
from deepserve.control.je.tasks import Task
from deepserve.control.je.routing.router import NoTEAvailable
from deepserve.messages.control import TEInfo
from deepserve.messages.engine import SubmitRequest

log = logging.getLogger(__name__)

Route = Callable[..., tuple[str, str | None, str | None]]
"""(ids, salt, model, exclude=) -> (TE, prefill TE, read path), or NoTEAvailable."""


class Isolation:
    """suspects: the crash book (read here, written by the JE); listed(): the
    listed TEs (te id -> TEInfo); layout(ids): colocated or disaggregated;
    route: the JE's route; send(msg, ids, te, prefill_te, is_suspect,
    read_path) -> sent; migrated(msg, te, num_tokens): a resumed request
    sent; fail(msg, error, text): a RequestFailed to its caller."""

    def __init__(self, suspects: SuspectBook, listed: Callable[[], Mapping[str, TEInfo]],
                 layout: Callable[[list[int]], str], route: Route,
                 send: Callable[..., bool], migrated: Callable[[SubmitRequest, str, int], None],
                 fail: Callable[[SubmitRequest, str, str], None],
                 held: HeldSuspects | None = None):
        self.suspects, self.listed, self.layout = suspects, listed, layout
        self.route, self.send, self.migrated, self.fail = route, send, migrated, fail
        self.held = held if held is not None else HeldSuspects()

    def __len__(self) -> int:
        """Suspects waiting."""
        return len(self.held)

    def hold(self, msg: SubmitRequest, ids: list[int], tasks: Iterable[Task]) -> None:
        """A resumed suspect waits here until it can run isolated (suspects.py)."""
        pushed_out = self.held.add(msg, ids)
        if pushed_out is not None:
            self.fail(pushed_out.msg, "engine_dead", "too many resumed requests wait for an engine")
        self.release(tasks)

    def drop(self, request_id: str) -> None:
        """The request was aborted."""
        self.held.drop(request_id)

    def note_listed(self, te_types: list[str]) -> None:
        """A TE list came (the spares a kind of job ever had: suspects.py)."""
        self.held.note_listed(te_types)

    def release(self, tasks: Iterable[Task]) -> None:
        """Send waiting suspects, oldest first, while isolation allows."""
        busy = frozenset(te for t in tasks if t.is_suspect
                         for te in (t.te_id, t.prefill_te) if te is not None)
        for held, is_expired, needs_spare in self.held.due(self.layout):
            if is_expired:
                self.held.remove(held)
                self.fail(held.msg, "engine_dead", "no engine could take the resumed request")
                continue
            if needs_spare and not self._has_spare(held.ids, busy):
                continue
            crashed = set(self.suspects.crashes(held.msg.request_id))
            try:  # back on a TE it crashed if that one is up: the others stay untouched
                te_id, prefill_te, path = self.route(
                    held.ids, held.msg.salt, held.msg.model,
                    exclude=busy | (set(self.listed()) - crashed),
                    request_id=held.msg.request_id)
            except NoTEAvailable:
                try:
                    te_id, prefill_te, path = self.route(held.ids, held.msg.salt,
                                                         held.msg.model, exclude=busy,
                                                         request_id=held.msg.request_id)
                except NoTEAvailable:
                    continue
            self.held.remove(held)
            log.warning("suspect %s runs isolated on %s (crashed before on %s)",
                        held.msg.request_id, te_id, ", ".join(crashed))
            if self.send(held.msg, held.ids, te_id, prefill_te, True, path):
                self.migrated(held.msg, te_id, len(held.ids))
                busy |= {te_id, prefill_te} - {None}

    def _has_spare(self, ids: list[int], busy: frozenset[str]) -> bool:
        """Another TE able to take the job's kind stays free of suspects."""
        listed = self.listed()
        if self.layout(ids) == "disaggregated":
            return len(set(listed) - busy) >= 3
        return sum(1 for te in listed.values()
                   if te.te_type == "colocated" and te.te_id not in busy) >= 2
