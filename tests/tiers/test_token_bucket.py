"""The storage read limit: burst, then the rate, in the order asked."""

import pytest

from deepserve.tiers.token_bucket import TokenBucket


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_burst_then_rate():
    clock = Clock()
    b = TokenBucket(rate=100.0, burst=50.0, clock=clock)
    assert b.reserve(50) == 0.0  # the burst
    assert b.reserve(100) == pytest.approx(1.0)  # 100 bytes owed at 100 B/s
    assert b.reserve(100) == pytest.approx(2.0)  # queued behind the first
    clock.t = 3.0  # all paid back; nothing accumulated past the burst
    assert b.reserve(10) == 0.0
    assert b.num_bytes == 260


def test_idle_time_refills_at_most_the_burst():
    clock = Clock()
    b = TokenBucket(rate=10.0, burst=20.0, clock=clock)
    b.reserve(20)
    clock.t = 100.0
    assert b.reserve(20) == 0.0 and b.reserve(10) == pytest.approx(1.0)


def test_unlimited_never_waits_and_bad_rates_are_refused():
    b = TokenBucket(rate=None)
    assert b.reserve(10**12) == 0.0 and b.num_bytes == 10**12
    for bad in (0, -1.0):
        with pytest.raises(ValueError):
            TokenBucket(rate=bad)
