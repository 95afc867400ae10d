"""TokenBucket: a byte-rate limit, standing in for an engine's storage NIC.

    bucket = TokenBucket(rate=2e8, burst=4 << 20)   # 200 MB/s, 4 MiB of burst
    time.sleep(bucket.reserve(nbytes))               # before reading nbytes

reserve() books the bytes at once and says how long the caller must wait
before it may use them (0 while the burst lasts), so concurrent readers are
served in the order they asked and the long-run rate never exceeds `rate`.
Pure: the clock is injectable; `rate` None means unlimited.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class TokenBucket:
    def __init__(self, rate: float | None, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s or None, got {rate}")
        self.rate = rate
        self.burst = float(burst if burst is not None else (rate or 0) * 0.05)
        self.clock = clock
        self._level = self.burst  # bytes that may go now (negative: owed)
        self._at = clock()
        self._lock = threading.Lock()
        self.num_bytes = 0  # booked so far

    def reserve(self, nbytes: int) -> float:
        """Book nbytes; the seconds to wait before using them."""
        with self._lock:
            self.num_bytes += nbytes
            if self.rate is None:
                return 0.0
            now = self.clock()
            self._level = min(self.burst, self._level + (now - self._at) * self.rate)
            self._at = now
            self._level -= nbytes
            return 0.0 if self._level >= 0 else -self._level / self.rate
