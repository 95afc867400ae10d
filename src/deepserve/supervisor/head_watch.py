"""A standby head's watch on the head: when to take over.

    head's cluster manager ──TEList / TEReport (every second)──> PUB
        └─ the standby's supervisor drains it every tick ──heard(now)──> HeadWatch
    supervisor tick ──check(now)──> silent for failover_s? ──promote(silent_s), once

Pure (every call carries `now`). Silence counts from the last message heard,
and only after one was heard: a standby that never saw the head has nothing
to stand in for (it joined, so it saw one; the node's start waits for it).
A standby promotes once: from then on its own cluster manager publishes on
the same socket list (config/cluster.py), and nothing here undoes that.

Why the CM's PUB: the head's cluster manager publishes at least every second
whatever the load (its TE list; from its start, before it has heard from its
TEs, an empty incomplete one: cluster_manager.py), so silence there means the
head host, its network, or its CM is gone. A CM that crashes on a live head
is restarted by the head's supervisor and heard again within about two
seconds (respawn delay, imports); failover_s must stay above that or the
standby takes over from a head that was coming back ([cluster] failover_s,
default 4 s).
"""

from __future__ import annotations

from typing import Callable


class HeadWatch:
    """promote(silent_s): called once, from check(), when the head has been
    silent for failover_s after it was heard at least once."""

    def __init__(self, failover_s: float, promote: Callable[[float], None]):
        self.failover_s = failover_s
        self.heard_at: float | None = None
        self.promoted_at: float | None = None
        self._promote = promote

    def heard(self, now: float) -> None:
        self.heard_at = now

    def check(self, now: float) -> bool:
        """True when this call promoted the standby."""
        if self.promoted_at is not None or self.heard_at is None \
                or now - self.heard_at < self.failover_s:
            return False
        self.promoted_at = now
        self._promote(now - self.heard_at)
        return True
