"""The sending end of the heartbeat channel, called from an actor's main loop.

    actor main loop: sender.beat(progress, holds_work)   every iteration
        └─ due? (interval passed, holds_work flipped, or force)
             └─ PUSH, non-blocking, SNDHWM small ──> supervisor PULL (bound)

Never blocks and never raises on a missing or slow supervisor: a message that
cannot be queued at once is dropped (`num_dropped` counts them); the next one
carries the current counters anyway. `beat()` that is not due costs one
time.monotonic() read (vDSO, no syscall) and a comparison.

There is deliberately no heartbeat *thread*: a side thread would keep beating
while the main loop is stuck in a collective or a deadlock.
"""

from __future__ import annotations

import os
import time

import msgspec
import zmq

from deepserve.messages.health import HealthEvent, Heartbeat, Ready


ENV_VAR = "DEEPSERVE_HEARTBEAT"
SEND_HWM = 16  # a few heartbeats queue at most; older ones are worthless anyway
EVENT_WAIT_S = 0.5
CLOSE_LINGER_MS = 200


class HeartbeatSender:
    """PUSH socket connected to the supervisor's inbox at `address`."""

    def __init__(self, ctx: zmq.Context, address: str, component: str,
                 interval_s: float = 0.5):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.address = address
        self.component = component
        self.interval_s = interval_s
        self.pid = os.getpid()
        self.num_sent = 0
        self.num_dropped = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._next_due = float("-inf")
        self._last_holds_work: bool | None = None
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        # IMMEDIATE: queue only to a connected peer, so with no supervisor
        # listening a send fails at once (dropped) instead of piling up.
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        try:
            self.socket.connect(address)
        except BaseException:
            self.socket.close(linger=0)
            raise

    @classmethod
    def from_env(cls, ctx: zmq.Context, component: str,
                 interval_s: float = 0.5) -> HeartbeatSender | None:
        """A sender to $DEEPSERVE_HEARTBEAT, or None when it is unset or empty
        (the actor runs without a supervisor)."""
        address = os.environ.get(ENV_VAR)
        if not address:
            return None
        return cls(ctx, address, component, interval_s)

    def beat(self, progress: dict[str, int], holds_work: bool, force: bool = False,
             details: dict | None = None) -> bool:
        """Send a Heartbeat if one is due: `interval_s` passed since the last
        send, `holds_work` changed since the last send, or `force`. Returns
        True if a message was queued (False: not due, or dropped)."""
        now = time.monotonic()
        if not force and now < self._next_due and holds_work == self._last_holds_work:
            return False
        self._next_due = now + self.interval_s
        self._last_holds_work = holds_work
        hb = Heartbeat(component=self.component, pid=self.pid, time=now,
                       progress=progress, holds_work=holds_work, details=details or {})
        return self._send(hb)

    def ready(self, details: dict | None = None) -> bool:
        """Tell the supervisor this component finished starting up. Sent once,
        usually right after connecting, and the scaler counts a pod warm only
        on it: like an event it waits up to EVENT_WAIT_S for the connection
        (a plain send would be dropped by IMMEDIATE while the pipe comes up)."""
        return self._send(Ready(component=self.component, pid=self.pid,
                                time=time.monotonic(), details=details or {}),
                          wait_s=EVENT_WAIT_S)

    def event(self, event: str, **details) -> bool:
        """A health-log event, written by the supervisor. Events are rare and
        are evidence (a drill's proof that its fault fired), so unlike beats
        they wait up to EVENT_WAIT_S for the connection (a process that
        reports a fault right after it started, then exits, is the case);
        dropped only if the supervisor is not listening by then."""
        return self._send(HealthEvent(component=self.component, pid=self.pid, event=event,
                                      details=details), wait_s=EVENT_WAIT_S)

    def _send(self, msg: Heartbeat | Ready | HealthEvent, wait_s: float = 0.0) -> bool:
        data = self._encoder.encode(msg)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.socket.send(data, flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.monotonic() >= deadline:
                    self.num_dropped += 1
                    return False
                time.sleep(0.01)
        self.num_sent += 1
        return True

    def close(self) -> None:
        # A short linger: what is queued (only ever to a connected supervisor,
        # IMMEDIATE) leaves before exit, e.g. an event sent just before it.
        self.socket.close(linger=CLOSE_LINGER_MS)

    def __enter__(self) -> HeartbeatSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullHeartbeat:
    """The sender of an actor with no supervisor: every call is a no-op, so
    actors never test `heartbeat is not None`."""

    num_sent = num_dropped = 0

    def beat(self, progress: dict[str, int], holds_work: bool, force: bool = False,
             details: dict | None = None) -> bool:
        return False

    def ready(self, details: dict | None = None) -> bool:
        return False

    def event(self, event: str, **details) -> bool:
        return False

    def close(self) -> None:
        pass
