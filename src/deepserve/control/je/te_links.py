"""The job executor's side of the TE list: who is listed, how to reach them.

    CM ──TEList──> TELinks.update() ──> (TEs to route among, TE ids that left)
    JE ──put(te_id, msg)──> Outboxes (a timeout per put) ──> the TE tokenizer's inbox

Four rules:
- complete lists only: a TEList with is_complete = False (a CM incarnation
  that has not heard from its TEs yet) changes nothing; until the first
  complete list `has_list` is False and the JE parks requests.
- the newest head term only: a list below the highest term heard is a
  deposed head's (messages/control.py TermFence) and changes nothing.
- the fence: a TE that left the list stays out of it for FENCE_S, whatever
  later lists say. A dying TE's host can announce itself once more after
  the supervisor's TEDown (it has not noticed its dead process yet), which
  put it back in the list for a moment: the JE then routed resumed requests
  to a TE that had just failed (their new attempt met the dead TE's
  tokenizer, still holding the old attempt: "request id ... is in use"),
  and counted its second removal as a second crash of its requests. No TE
  restarts within FENCE_S (respawn delay, start, load, warm-up), so the
  fence never hides a restarted TE for longer than one TE-list republish.
- no blocking send: a put waits at most `send_timeout_s` for a TE that does
  not take it (queue full, tokenizer gone); put() says False and the JE
  fails that request with a retryable error. After one timeout the TE's
  address sends without waiting until a put goes through (ipc/outboxes.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from deepserve.ipc.outboxes import Outboxes
from deepserve.messages.control import TEInfo, TEList, TermFence

log = logging.getLogger(__name__)
FENCE_S = 3.0
"""Seconds a TE that left the list is kept out of it (module doc)."""
SEND_TIMEOUT_S = 0.5
"""Seconds a put to a TE's inbox may wait."""


class TELinks:
    def __init__(self, ctx: zmq.Context, send_timeout_s: float = SEND_TIMEOUT_S,
                 fence_s: float = FENCE_S, clock: Callable[[], float] = time.monotonic):
        self.outboxes = Outboxes(ctx, timeout_s=send_timeout_s)
        self.fence_s, self.clock = fence_s, clock
        self.addresses: dict[str, str] = {}  # listed TE id -> its inbox
        self.left_at: dict[str, float] = {}  # TE id -> when it last left the list
        self.has_list = False  # a complete TE list came in
        self.cm_incarnation: str | None = None
        self.terms = TermFence()

    def update(self, msg: TEList) -> tuple[list[TEInfo], list[str]] | None:
        """(the TEs listed now, the TE ids that left); None for an incomplete
        list or a deposed head's, which change nothing."""
        if not self.terms.admits(msg) or not msg.is_complete:
            return None
        if msg.cm_incarnation != self.cm_incarnation:
            if self.cm_incarnation is not None:
                log.warning("cluster manager incarnation %s: %d TE(s) listed",
                            msg.cm_incarnation or "?", len(msg.tes))
            self.cm_incarnation = msg.cm_incarnation
        self.has_list = True
        now = self.clock()
        live = {te.te_id: te for te in msg.tes if not self._is_fenced(te.te_id, now)}
        left = [te_id for te_id in self.addresses if te_id not in live]
        for te_id in left:
            self.outboxes.forget(self.addresses.pop(te_id))  # drops what it never took
            self.left_at[te_id] = now
        for te_id, te in live.items():
            if self.addresses.get(te_id) != te.address:
                if te_id in self.addresses:
                    self.outboxes.forget(self.addresses[te_id])
                self.addresses[te_id] = te.address
        return list(live.values()), left

    def _is_fenced(self, te_id: str, now: float) -> bool:
        left = self.left_at.get(te_id)
        if left is None:
            return False
        if now - left < self.fence_s:
            return True
        del self.left_at[te_id]
        return False

    def put(self, te_id: str, msg) -> bool:
        """Send to a listed TE; False if it is not listed or did not take it in time."""
        address = self.addresses.get(te_id)
        return address is not None and self.outboxes.put(address, msg)

    def __contains__(self, te_id: str) -> bool:
        return te_id in self.addresses

    def __bool__(self) -> bool:
        return bool(self.addresses)

    def close(self) -> None:
        self.outboxes.close()
