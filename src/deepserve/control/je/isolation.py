"""Resumed suspects run isolated (the job executor's IsolationSide; the rules
and their trade-off: control/je/suspects.py).

A request in flight on a TE that crashed resumes, with [router]
isolate_suspects, only where it cannot take a second TE down with another
suspect: never beside another suspect, only while another TE of its kind
stays free of suspects, and back on the TE it crashed once that one is up.
"""

from __future__ import annotations

import logging

from deepserve.control.routing.router import NoTEAvailable
from deepserve.messages.engine import SubmitRequest

log = logging.getLogger(__name__)


class IsolationSide:
    """Subclass state it relies on: held (HeldSuspects), suspects (SuspectBook),
    tasks, router, _route, _send_task, _note_migrated, _fail, _job_layout."""

    def _hold(self, msg: SubmitRequest, ids: list[int]) -> None:
        """A resumed suspect waits here until it can run isolated (suspects.py)."""
        pushed_out = self.held.add(msg, ids)
        if pushed_out is not None:
            self._fail(pushed_out.msg, "engine_dead", "too many resumed requests wait for an engine")
        self._release_held()

    def _release_held(self) -> None:
        """Send waiting suspects, oldest first, while isolation allows."""
        busy = frozenset(te for t in self.tasks.values() if t.is_suspect
                         for te in (t.te_id, t.prefill_te) if te is not None)
        for held, is_expired, needs_spare in self.held.due(self._job_layout):
            if is_expired:
                self.held.remove(held)
                self._fail(held.msg, "engine_dead", "no engine could take the resumed request")
                continue
            if needs_spare and not self._has_spare(held.ids, busy):
                continue
            crashed = set(self.suspects.crashes(held.msg.request_id))
            try:  # back on a TE it crashed if that one is up: the others stay untouched
                te_id, prefill_te, path = self._route(
                    held.ids, held.msg.salt, held.msg.model,
                    exclude=busy | (set(self.router.tes) - crashed))
            except NoTEAvailable:
                try:
                    te_id, prefill_te, path = self._route(held.ids, held.msg.salt,
                                                          held.msg.model, exclude=busy)
                except NoTEAvailable:
                    continue
            self.held.remove(held)
            log.warning("suspect %s runs isolated on %s (crashed before on %s)",
                        held.msg.request_id, te_id, ", ".join(crashed))
            if self._send_task(held.msg, held.ids, te_id, prefill_te, True, path):
                self._note_migrated(held.msg, te_id, len(held.ids))
                busy |= {te_id, prefill_te} - {None}

    def _has_spare(self, ids: list[int], busy: frozenset[str]) -> bool:
        """Another TE able to take the job's kind stays free of suspects."""
        if self._job_layout(ids) == "disaggregated":
            return len(set(self.router.tes) - busy) >= 3
        return sum(1 for te in self.router.tes.values()
                   if te.te_type == "colocated" and te.te_id not in busy) >= 2

