"""HeadWatch: a standby head takes over once, after failover_s of silence
from a head it has heard (fake clock)."""

from __future__ import annotations

from deepserve.supervisor.head_watch import HeadWatch


def test_a_standby_takes_over_once_after_failover_s_of_silence():
    promoted: list[float] = []
    watch = HeadWatch(4.0, promoted.append)
    assert not watch.check(100.0)  # never heard a head: nothing to stand in for
    watch.heard(10.0)
    assert not watch.check(13.75)  # under failover_s
    watch.heard(14.0)  # the head spoke again: silence starts over
    assert not watch.check(17.75) and promoted == []
    assert watch.check(18.0)  # exactly failover_s of silence
    assert promoted == [4.0] and watch.promoted_at == 18.0
    watch.heard(18.5)  # its own CM publishes from now on
    assert not watch.check(30.0) and promoted == [4.0]  # once
