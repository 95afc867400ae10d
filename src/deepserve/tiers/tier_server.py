"""The node's KV tier service: host DRAM pools and the disk tier, for every TE.

    TE masters, JE ──ToTier──> [inbox PULL] ──> TierIndex per model key (tier_index.py)
                                    │    └──replies (Outboxes)──> each master's reply_to
                                    │ commit: slots to copy to disk
                                    ▼
                    disk writer thread: host slot ──write_block──> DIR/<key>/..
                                    │ results (queue) ──> disk_written, deletes
    every REPORT_S: TierReport ──> cluster manager (relayed to gateways: /metrics)

Many hosts ([cluster]): a lookup whose run stops short may wait for the
blocks other hosts' tier services hold (remote_tier.py: fetched over tcp
when the link beats recomputing), which land in this host pool first; this
service serves its own host pool to them the same way.

Host pools: one shared-memory segment per model key, (num_slots, 2, L, H,
bs, D) in the model's dtype, created on the key's first message (its
geometry is in every lookup / reserve); workers attach it by name and copy
blocks in and out themselves: no tensor ever rides in a message. Every
key's pool gets host_cache_bytes / num_models bytes, its disk directory
disk_cache_bytes / num_models, its context pins context_cache_bytes /
num_models (0: half of its lowest persistent tier).

A disk that fails a write (ENOSPC, any OSError) turns the disk tier off for
every key, loudly (`cache_tier_disabled`), and serving goes on from host;
the disk thread probes it every few seconds and turns it back on once a
write goes through (`cache_tier_enabled`, its files found again). While on,
the disk thread scrubs the block files: a corrupt one is dropped and deleted
(`cache_block_corrupt`) before a TE reads it (disk_upkeep.py).
A restarted service starts with empty host pools (a miss, never a wrong
block: the segments of its predecessor are gone) and finds the disk tier's
files again (scan_blocks). Only this process creates and unlinks its pools.

`python -m deepserve.tiers.tier_server --conf RUN_DIR/node.json --role kv-cache
--run-id ID`.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import zmq

from deepserve.actor import ActorLife, run_main
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.segments import create_segment, segment_name, unlink_segment
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.messages.cache import (BlockGeometry, ContextUnpin, PeerGet, TierCommit,
                                      TierCommitted, TierDrop, TierHits, TierLookup, TierRelease,
                                      TierReport, TierReserve, TierReserved, ToTier)
from deepserve.tiers import block_file
from deepserve.tiers.disk_upkeep import TICK_S, Corrupt, DiskBack, DiskUpkeep
from deepserve.tiers.remote_tier import Fetch, RemoteTier, read_run, write_blocks
from deepserve.tiers.tier_index import TierIndex
from deepserve.tiers.tier_settings import TierSettings, load_settings

log = logging.getLogger(__name__)
REPORT_S = 1.0
EXPIRE_S = 0.25
MAX_KEYS = 64  # model keys at most (each has a pool): a forged key cannot exhaust memory


@dataclass
class _Pool:
    key: str
    geometry: BlockGeometry
    index: TierIndex
    segment: str
    shm: object
    slots: np.ndarray  # (num_slots, block bytes) uint8 over the segment
    disk_dir: str


class TierServer:
    def __init__(self, s: TierSettings, ctx: zmq.Context, life: ActorLife | None = None):
        self.s, self.life = s, life
        self.inbox = PullSocket(ctx, s.inbox, bind=True, type=ToTier)
        self.replies = Outboxes(ctx, timeout_s=0.2)
        self.to_cm = PushSocket(ctx, s.cm, bind=False) if s.cm else None
        self.pools: dict[str, _Pool] = {}
        self.has_disk = bool(s.disk_dir and s.disk_bytes > 0)
        self.disk_enabled = self.has_disk
        self.num_corrupt = self.num_handled = 0
        self._disk_pools: dict[str, tuple[BlockGeometry, str]] = {}  # for the disk thread
        self.upkeep = DiskUpkeep(s.disk_dir, lambda: self._disk_pools,
                                 lambda: self._drill_disk_full,
                                 scrub_bytes_per_s=s.scrub_bytes_per_s)
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._drill_disk_full = False  # the writer reads it; step() sets it
        self._writer = threading.Thread(target=self._write_loop, name="disk-writer",
                                         daemon=True)
        self._writer.start()
        self._reported = self._expired = 0.0
        self.remote = RemoteTier(ctx, s.peer, s.cm_pub) if s.peer else None

    # -- the loop -------------------------------------------------------------------
    def step(self) -> None:
        if self.life is not None:  # drill: the disk is full (read here: the hook reports)
            self._drill_disk_full = self.life.faults.active("disk-full") is not None
        if self.inbox.poll(0.05):
            for msg in self.inbox.drain():
                self.handle(msg)
                self.num_handled += 1
        self._apply_disk_results()
        now = time.monotonic()
        if self.remote is not None:
            self.remote.learn(now)
            self.remote.serve(self._read_for_peer)
            for fetched in self.remote.finished():
                self._apply_fetch(fetched, now)
        if now - self._expired >= EXPIRE_S:
            self._expired = now
            for pool in self.pools.values():
                self._delete(pool, pool.index.expire(now, time.time()))
        if self.to_cm is not None and now - self._reported >= REPORT_S:
            self._reported = now
            try:
                self.to_cm.put(self.report(), timeout=0.2)
            except TimeoutError:
                pass

    def handle(self, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, TierLookup):
            self._answer(msg, now, self.remote)
        elif isinstance(msg, TierReserve):
            pool = self._pool(msg.model_key, msg.geometry)
            if pool is None:
                self._reply(msg.reply_to, TierReserved(reserve_id=msg.reserve_id,
                                                       error="unavailable"))
                return
            lease, slots, error = pool.index.reserve(msg.hashes, now, msg.context_id,
                                                     msg.expires_at, hold=msg.hold,
                                                     on_host=msg.on_host)
            self._reply(msg.reply_to, TierReserved(reserve_id=msg.reserve_id, lease_id=lease,
                                                   slots=slots, segment=pool.segment,
                                                   error=error))
        elif isinstance(msg, TierCommit):
            pool = self.pools.get(msg.model_key)
            ok = pool is not None
            if ok:
                for slot, h in pool.index.commit(msg.lease_id, msg.slots, msg.hold):
                    self._writes.put((pool.key, slot, h))
                self._reap(pool)
            if msg.reply_to:
                self._reply(msg.reply_to, TierCommitted(reserve_id=msg.reserve_id, ok=ok))
        elif isinstance(msg, TierRelease):
            pool = self.pools.get(msg.model_key)
            if pool is not None:
                pool.index.release(msg.lease_id)
                self._reap(pool)
        elif isinstance(msg, TierDrop):
            pool = self.pools.get(msg.model_key)
            if pool is not None:
                self.num_corrupt += len(msg.hashes)
                self._delete(pool, pool.index.drop_disk(msg.hashes))
        elif isinstance(msg, ContextUnpin):
            for pool in self.pools.values():
                self._delete(pool, pool.index.unpin(msg.context_id))

    def _answer(self, msg: TierLookup, now: float, remote: RemoteTier | None = None) -> None:
        """TierHits for what this host holds; with a remote tier, a lookup whose
        run stops short waits for what other hosts hold when that is worth it
        (remote_tier.py), and is answered by _apply_fetch."""
        pool = self._pool(msg.model_key, msg.geometry)
        lease, slots = pool.index.lookup(msg.hashes, now, count=not msg.is_turn_pin) \
            if pool else (0, [])
        missing = len(msg.hashes) - len(slots)
        if remote is not None and pool is not None and remote.worth_fetching(
                msg, missing, pool.index.block_bytes):
            pool.index.release(lease)
            remote.fetch(Fetch(msg, len(slots), pool.index.block_bytes))
            return
        self._reply(msg.reply_to, TierHits(
            lookup_id=msg.lookup_id, lease_id=lease, slots=slots,
            segment=pool.segment if pool else "", disk_dir=pool.disk_dir if pool else ""))

    def _apply_fetch(self, fetched: Fetch, now: float) -> None:
        """Blocks another host sent: into this host pool (and on to disk, as a
        TE's write would go), then the lookup answered from here."""
        pool = self.pools.get(fetched.lookup.model_key)
        if pool is not None and fetched.count:
            hashes = fetched.lookup.hashes[fetched.start:fetched.start + fetched.count]
            for slot, h in write_blocks(pool.index, pool.slots, hashes, fetched.data, now):
                self._writes.put((pool.key, slot, h))
            self._reap(pool)
        self._answer(fetched.lookup, now)

    def _read_for_peer(self, msg: PeerGet) -> tuple[int, bytes | np.ndarray]:
        pool = self.pools.get(msg.model_key)
        if pool is None or pool.geometry != msg.geometry:
            return 0, b""
        found = read_run(pool.index, pool.slots, msg.hashes, time.monotonic())
        self._reap(pool)
        return found

    def _reply(self, address: str, msg) -> None:
        self.replies.put(address, msg)

    # -- pools -----------------------------------------------------------------------
    def _pool(self, key: str, geometry: BlockGeometry) -> _Pool | None:
        pool = self.pools.get(key)
        if pool is not None:
            return pool if pool.geometry == geometry else None
        if len(self.pools) >= MAX_KEYS or geometry.dtype not in block_file._ITEMSIZE:
            return None
        nbytes = block_file.block_nbytes(geometry)
        if nbytes <= 0 or nbytes > (1 << 30):
            return None
        num_slots = self.s.host_bytes // nbytes
        if num_slots < 1:
            return None
        digest = hashlib.sha1(key.encode()).hexdigest()[:10]
        name = segment_name(self.s.run_id, f"kvh-{digest}")
        shm = create_segment(name, num_slots * nbytes)
        slots = np.frombuffer(shm.buf, dtype=np.uint8).reshape(num_slots, nbytes)
        disk_dir = str(Path(self.s.disk_dir) / _dir_name(key)) if self.has_disk else ""
        index = TierIndex(num_slots, nbytes, self.s.disk_bytes if self.has_disk else 0,
                          self.s.pin_bytes or None, self.s.lease_s)
        pool = self.pools[key] = _Pool(key, geometry, index, name, shm, slots, disk_dir)
        if self.disk_enabled:
            self._find_files(pool)
        elif self.has_disk:
            index.disable_disk()
        log.info("host pool %s for %s: %d slots of %d bytes, disk %s", name, key, num_slots,
                 nbytes, disk_dir or "off")
        return pool

    def _find_files(self, pool: _Pool) -> None:
        """Its block files on disk into its index, oldest first (a restart, the tier back on)."""
        for h, size, _ in sorted(block_file.scan_blocks(pool.disk_dir), key=lambda e: e[2]):
            pool.index.add_disk(h, size)
        self._delete(pool, pool.index.evict_disk())
        self._disk_pools = {**self._disk_pools, pool.key: (pool.geometry, pool.disk_dir)}

    # -- disk ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        """One block at a time: read-pinned slot -> file; never touches the
        index. With nothing to write: upkeep (disk_upkeep.py)."""
        while True:
            try:
                job = self._writes.get(timeout=TICK_S)
            except queue.Empty:
                job = ()
            if job is None:
                return
            if job:
                self._write(*job)
            if self.has_disk and self.upkeep.is_due():
                try:
                    for found in self.upkeep.tick(self.disk_enabled):
                        self._done.put(found)
                except Exception:  # a bug: no upkeep this round; the writes go on
                    log.exception("disk upkeep failed")

    def _write(self, key: str, slot: int, h: int) -> None:
        """One block: read-pinned slot -> file."""
        pool = self.pools.get(key)
        if pool is None or not self.disk_enabled:  # not the disk's failure
            self._done.put((key, slot, h, 0, _NotWritten("disk tier off")))
            return
        try:
            if self._drill_disk_full:
                raise OSError(28, "No space left on device (drill)")
            nbytes = block_file.write_block(pool.disk_dir, h, pool.geometry,
                                            memoryview(pool.slots[slot]), self.s.fsync)
            self._done.put((key, slot, h, nbytes, None))
        except OSError as e:
            self._done.put((key, slot, h, 0, e))
        except Exception as e:  # a bug: this block is not written; the thread lives on
            log.exception("disk write of block %x failed", h)
            self._done.put((key, slot, h, 0, _NotWritten(str(e))))

    def _apply_disk_results(self) -> None:
        while True:
            try:
                result = self._done.get_nowait()
            except queue.Empty:
                return
            if isinstance(result, (DiskBack, Corrupt)):
                self._on_upkeep(result)
                continue
            key, slot, h, nbytes, error = result
            pool = self.pools[key]
            gone = pool.index.disk_written(slot, h, nbytes, error is None)
            self._delete(pool, gone)
            if isinstance(error, OSError) and self.disk_enabled:
                self._disable_disk(error)

    def _disable_disk(self, error: OSError) -> None:
        self.disk_enabled = False
        self._disk_pools = {}
        log.error("disk tier disabled: %s", error)
        for pool in self.pools.values():
            pool.index.disable_disk()
        self._event("cache_tier_disabled", tier="disk", reason=str(error))

    def _on_upkeep(self, found: DiskBack | Corrupt) -> None:
        if isinstance(found, DiskBack):
            if self.disk_enabled:
                return
            self.disk_enabled = True
            for pool in self.pools.values():
                pool.index.enable_disk()
                self._find_files(pool)
            log.warning("disk tier enabled again: a probe write went through")
            self._event("cache_tier_enabled", tier="disk")
            return
        pool = self.pools.get(found.key)
        if pool is None or not self.disk_enabled:
            return
        self.num_corrupt += 1
        log.warning("scrub: %s", found.why)
        self._delete(pool, pool.index.drop_disk([found.block_hash]) or [found.block_hash])
        self._event("cache_block_corrupt", tier="disk", block=found.block_hash, by="scrub")

    def _event(self, event: str, **details) -> None:
        if self.life is not None:
            self.life.event(event, **details)

    def _reap(self, pool: _Pool) -> None:
        """The block files the index let go of on its last change, deleted."""
        self._delete(pool, pool.index.reaped)
        pool.index.reaped = []

    def _delete(self, pool: _Pool, hashes: list[int]) -> None:
        self._delete_files(pool.disk_dir, hashes)

    @staticmethod
    def _delete_files(disk_dir: str, hashes: list[int]) -> None:
        for h in hashes:
            try:
                block_file.delete_block(disk_dir, h)
            except OSError as e:
                log.warning("cannot delete block file %x: %s", h, e)

    def report(self) -> TierReport:
        pools = list(self.pools.values())
        return TierReport(
            host_bytes=sum(p.index.num_valid * p.index.block_bytes for p in pools),
            host_capacity=sum(p.index.num_slots * p.index.block_bytes for p in pools),
            disk_bytes=sum(p.index.disk_bytes for p in pools),
            disk_capacity=self.s.disk_bytes * len(pools) if self.disk_enabled else 0,
            num_contexts=sum(len(p.index.contexts) for p in pools),
            pinned_bytes=sum(p.index.pinned_bytes for p in pools),
            disk_enabled=self.disk_enabled, num_corrupt=self.num_corrupt,
            peer=self.s.peer, num_remote_hits=self.remote.num_fetched if self.remote else 0,
            num_turn_pins=sum(len(p.index.host_pins.pins) for p in pools),
            turn_pin_hits=sum(p.index.host_pins.num_hits for p in pools),
            turn_pins_refused=sum(p.index.host_pins.num_refused for p in pools))

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(5)
        for pool in self.pools.values():
            pool.slots = None
            try:
                pool.shm.close()
            except BufferError:  # a view is still alive: the name goes anyway
                pass
            unlink_segment(pool.segment)
        if self.remote is not None:
            self.remote.close()
        for sock in (self.inbox, self.replies, self.to_cm):
            if sock is not None:
                sock.close()


class _NotWritten(Exception):
    """A disk write that failed for a reason other than the disk: not the tier's fault."""


def _dir_name(key: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:64]
    return f"{safe}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def main(argv: list[str] | None = None) -> None:
    run_main("kv-cache", "DeepServe KV tier service (host + disk)", argv, load_settings,
             lambda ctx, s, life: TierServer(s, ctx, life),
             lambda server: {"messages": server.num_handled})


if __name__ == "__main__":
    main()
