"""Outboxes: PUSH sockets to many peers, one per address, that never block for long.

    actor ──put(address, msg)──> PUSH (connected on first use) ──> the peer's PULL

Every reply path (a TE's tokenizer to the gateway that submitted, the JE to
a request's reply_to, a master to a peer master) sends through one of these,
because the address comes from a message and the peer may be gone:

- an address ZeroMQ refuses (malformed, unknown transport, a path too long)
  is logged once and every message to it is dropped: a crafted reply_to
  never kills the sender; so is a list of endpoints ("tcp://a,tcp://b")
  unless the owner named it in `lists` (its own config's: every head's CM
  inbox): a socket to several waits for one to be there, which cost the
  sender a whole timeout per crafted reply_to;
- a put waits at most `timeout_s` for a peer that does not take it (its
  queue full, or nobody connected); after one timeout the address is
  *stalled* and later puts do not wait at all until one goes through again,
  so a dead gateway costs the sender one timeout, not one per token;
- put(..., probe=True) waits even to a stalled address (up to PROBE_WAIT_S,
  at most once per PROBE_EVERY_S per address, so the requests of a dead
  caller cost the sender little): the first reply to a request its caller
  has just sent. A gateway restarted on
  the same address first receives the backlog ZeroMQ kept for the dead one
  (a connecting PUSH keeps its queue across reconnects); a put that did not
  wait found that queue full, and the TE aborted the new gateway's first
  request as "caller gone" (seen under load: the client waited out its
  deadline for a request the TE had dropped).

put() returns False for a dropped message; the caller decides what that
means (a stream the client no longer reads, a peer that will time out).

A socket not put to for IDLE_S is closed (and reconnects on the next put):
peers come and go under one sender's life (each scaled TE, pod and
restarted TE has its own address) and nobody tells every sender; the tier
service kept one socket, one fd, per master it ever answered (+48 fds in a
60-minute chaos run, one per TE the autoscaler started), the gateway one
per TE it ever aborted at. What an idle socket still queues has waited
IDLE_S for a peer that took nothing: it is dropped with it.

At most `max_sockets` are open at once: opening one more closes the one put
to least recently (what it still queues is dropped). The addresses come from
messages, so without the cap a stream of requests each naming a reply_to of
its own held one socket and one fd apiece for IDLE_S.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import zmq

from deepserve.ipc.sockets import PushSocket, endpoints

log = logging.getLogger(__name__)
PROBE_WAIT_S, PROBE_EVERY_S = 0.2, 1.0
IDLE_S = 120.0
"""Seconds without a put after which an address's socket is closed (module doc)."""
MAX_SOCKETS = 1024
"""Sockets open at once per Outboxes (module doc): far above the peers one
sender has (gateways, TEs, masters), far below a process's fd limit."""


class Outboxes:
    def __init__(self, ctx: zmq.Context, timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, idle_s: float = IDLE_S,
                 max_sockets: int = MAX_SOCKETS, lists: tuple[str, ...] = ()):
        self.ctx, self.timeout_s, self.clock, self.idle_s = ctx, timeout_s, clock, idle_s
        self.max_sockets, self.lists = max_sockets, lists
        self._sockets: dict[str, PushSocket] = {}
        self._used: dict[str, float] = {}  # address -> its last put
        self._swept_at = clock()
        self._refused: set[str] = set()
        self._stalled: set[str] = set()
        self._probed: dict[str, float] = {}  # stalled address -> its last probe
        self.num_dropped = 0
        """Messages not sent: refused address or a peer that did not take them in time."""
        self.num_evicted = 0
        """Sockets closed to keep max_sockets (the least recently put to)."""

    def put(self, address: str, msg: Any, probe: bool = False) -> bool:
        now = self.clock()
        self._close_idle(now)
        sock = self._socket(address)
        if sock is None:
            self.num_dropped += 1
            return False
        self._used[address] = now
        wait = self.timeout_s
        if address in self._stalled:
            wait = 0.0
            if probe and now - self._probed.get(address, -PROBE_EVERY_S) >= PROBE_EVERY_S:
                wait, self._probed[address] = min(self.timeout_s, PROBE_WAIT_S), now
        try:
            sock.put(msg, timeout=wait)
        except TimeoutError:
            if address not in self._stalled:
                log.warning("peer %s does not take %s: dropping until it does", address,
                            type(msg).__name__)
                self._stalled.add(address)
            self.num_dropped += 1
            return False
        self._stalled.discard(address)
        self._probed.pop(address, None)
        return True

    def __len__(self) -> int:
        """Sockets open (one per address put to and not forgotten)."""
        return len(self._sockets)

    def is_stalled(self, address: str) -> bool:
        return address in self._stalled or address in self._refused

    def _socket(self, address: str) -> PushSocket | None:
        sock = self._sockets.get(address)
        if sock is not None or address in self._refused:
            return sock
        if len(self._sockets) >= self.max_sockets:
            self.num_evicted += 1
            self.forget(min(self._sockets, key=lambda a: self._used.get(a, float("-inf"))))
        try:
            if len(endpoints(address)) != 1 and address not in self.lists:
                raise ValueError("one peer per reply address, not a list")
            sock = self._sockets[address] = PushSocket(self.ctx, address, bind=False)
        except (zmq.ZMQError, ValueError, TypeError, UnicodeError) as exc:
            log.warning("cannot send to %r (%s): its messages are dropped", address[:200], exc)
            if len(self._refused) < 10_000:
                self._refused.add(address)
        return sock

    def _close_idle(self, now: float) -> None:
        """Close the sockets not put to for idle_s (checked at most every idle_s / 4)."""
        if now - self._swept_at < self.idle_s / 4:
            return
        self._swept_at = now
        for address in [a for a, used in self._used.items() if now - used >= self.idle_s]:
            self.forget(address)

    def forget(self, address: str) -> None:
        """Close the socket to `address` (its peer left for good)."""
        self._used.pop(address, None)
        sock = self._sockets.pop(address, None)
        if sock is not None:
            sock.close()
        self._stalled.discard(address)
        self._probed.pop(address, None)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets, self._used = {}, {}
