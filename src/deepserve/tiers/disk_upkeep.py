"""What the tier service's disk thread does between block writes: probe a
disk tier that was turned off, and scrub the one that is on.

    disk thread, every TICK_S between writes ──DiskUpkeep.tick()──> findings
        tier off:  every PROBE_S a block-sized file written and removed
                   ──it went through──> DiskBack: the service turns the tier on again
        tier on:   block files read and checked, scrub_bytes_per_s at most
                   ──header or checksum wrong──> Corrupt(key, hash): dropped, deleted

A full disk turns the tier off at the first failed write (tier_server.py);
without the probe it stayed off until the service restarted, although the
disk had room again minutes later. The scrub finds a damaged file before a
TE reads it (a TE that reads one first reports it too: a miss, never a wrong
block); at the default rate ([node] disk_scrub_bytes_per_s, 4 MiB/s) a 4 GiB
tier is read once in about 17 minutes.

Thread-safe by construction: the thread reads files and the `pools` it is
handed (key -> (geometry, directory), a copy made on the service's thread),
never the index; what it finds goes back through the service's results queue.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from deepserve.messages.cache import BlockGeometry
from deepserve.tiers import block_file

log = logging.getLogger(__name__)
TICK_S = 0.25
"""The disk thread waits this long for a write before it does upkeep."""
PROBE_S = 5.0
"""Seconds between probes of a disk tier that is off."""
PROBE_NAME = ".probe"


@dataclass(frozen=True)
class DiskBack:
    """The probe wrote and removed a block-sized file: the disk takes writes again."""


@dataclass(frozen=True)
class Corrupt:
    key: str
    block_hash: int
    why: str


Pools = Callable[[], dict[str, tuple[BlockGeometry, str]]]


class DiskUpkeep:
    def __init__(self, root: str, pools: Pools, disk_full: Callable[[], bool],
                 scrub_bytes_per_s: float, probe_s: float = PROBE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.root, self.pools, self.disk_full = root, pools, disk_full
        self.scrub_bytes_per_s, self.probe_s, self.clock = scrub_bytes_per_s, probe_s, clock
        self._probed_at = float("-inf")
        self._ticked_at = clock()
        self._todo: deque[tuple[str, int]] = deque()  # (key, hash) still to scrub this pass
        self.num_scrubbed = 0

    def is_due(self) -> bool:
        """TICK_S since the last tick (the thread ticks between writes too)."""
        return self.clock() - self._ticked_at >= TICK_S

    def tick(self, enabled: bool) -> list:
        """One round of upkeep; what it found (DiskBack, Corrupt)."""
        now = self.clock()
        elapsed, self._ticked_at = min(max(now - self._ticked_at, 0.0), 4 * TICK_S), now
        if not enabled:
            return self._probe(now)
        return self._scrub(elapsed * self.scrub_bytes_per_s)

    def _probe(self, now: float) -> list:
        if now - self._probed_at < self.probe_s:
            return []
        self._probed_at = now
        size = max((block_file.block_nbytes(g) for g, _ in self.pools().values()), default=4096)
        path = Path(self.root) / PROBE_NAME
        try:
            if self.disk_full():
                raise OSError(28, "No space left on device (drill)")
            Path(self.root).mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(bytes(size))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            log.info("disk tier still off: the probe write failed: %s", e)
            return []
        finally:
            path.unlink(missing_ok=True)
        return [DiskBack()]

    def _scrub(self, budget: float) -> list:
        pools = self.pools()
        if not self._todo:
            for key, (_, disk_dir) in pools.items():
                self._todo.extend((key, h) for h, _, _ in block_file.scan_blocks(disk_dir))
        found = []
        while self._todo and budget > 0:
            key, h = self._todo.popleft()
            if key not in pools:
                continue
            geometry, disk_dir = pools[key]
            budget -= block_file.block_nbytes(geometry)
            try:
                block_file.read_block(disk_dir, h, geometry)
            except FileNotFoundError:
                continue  # evicted since the pass began
            except block_file.BlockCorrupt as e:
                found.append(Corrupt(key, h, str(e)))
            except OSError as e:
                log.warning("scrub cannot read block %s: %s", block_file.hash_name(h), e)
            self.num_scrubbed += 1
        return found
