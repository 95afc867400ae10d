"""The worker's RTC executor: a step's cache ops, copied on a thread of their own.

    StepBatch.cache_ops ──submit──> memory thread: host <-> device copies
                                └──> storage thread: block files (the TE's storage bucket)
                              each thread ──CacheOpsDone (its own PUSH)──> master

Each rank copies only its own KV heads (h0 .. h1 of the model's H): a host
slot and a disk file hold a full block, (2, L, H, bs, D), whatever the tp of
the TEs that write or read it. The forward never waits for these copies:

  load_host / load_disk write device blocks that only a populate holder
      owns (engine/tiers/coordinator.py), which no step reads before this op is done;
  store_host reads committed blocks (immutable; the master pins them until
      this op is done), written by steps that finished before this op was
      taken off the ring (the worker takes batches in order);
  load_layers is primed here (the storage thread) and finished by its
      sequence's next forward (layer_loads.py); it writes only that
      sequence's own blocks.
  stage_stream reads block files into a buffer of this worker's own, served
      as a layer stream (transfer/layer_stream.py) for a prefill TE (a
      decode TE's), or read in place by this worker's own layered load (a
      prefill TE's read-ahead while its request waits for room), until
      drop_stream, the forward that read it (its own), or its ttl.

Each thread owns its socket; copies are torch ops on the pool and on the
host pool's shared memory (attached by name, the mapping kept until the
name changes: a restarted tier service has new pools). A load stops at the
first block it cannot get (a missing or corrupt file): CacheOpsDone.num_ok.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import torch
import zmq

from deepserve.ipc.segments import attach_segment
from deepserve.ipc.sockets import PushSocket
from deepserve.messages.cache import (DROP_LAYERS, DROP_STREAM, LOAD_DISK, LOAD_HOST,
                                      LOAD_LAYERS, ON_DISK, ON_STREAM, STAGE_DISK,
                                      STAGE_STREAM, STORE_HOST, BlockGeometry, CacheOp,
                                      CacheOpsDone)
from deepserve.tiers import block_file
from deepserve.tiers.token_bucket import TokenBucket
from deepserve.transfer.layer_stream import LayerStreamServer
from deepserve.worker.layer_loads import LayerLoad, LayerLoads

log = logging.getLogger(__name__)


def host_to_pool(pool: torch.Tensor, slots: torch.Tensor, slot_ids: list[int],
                 block_ids: list[int], h0: int, h1: int) -> None:
    """Host slots (num_slots, 2, L, H, bs, D) -> device blocks, KV heads h0..h1."""
    s = torch.tensor(slot_ids, dtype=torch.long)
    b = torch.tensor(block_ids, dtype=torch.long)
    src = slots.index_select(0, s)[:, :, :, h0:h1]  # (n, 2, L, Hl, bs, D)
    pool.index_copy_(3, b, src.permute(1, 2, 3, 0, 4, 5))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CacheExecutor:
    """pool: this rank's (2, L, Hl, NB, bs, D) KV pool; the model has Hl * tp KV heads.
    stream: (bind, max bytes, ttl s) of the layer streams rank 0 serves for stage_stream
    ("tcp://HOST:0"; None: no stage_stream here)."""

    def __init__(self, pool: torch.Tensor, rank: int, tp: int, ctx: zmq.Context,
                 done_address: str, storage_read_gbps: float | None = None,
                 stream: tuple[str, int, float] | None = None):
        two, layers, local_heads, self.num_blocks, bs, dim = pool.shape
        self.pool, self.rank = pool, rank
        self.h0, self.h1 = rank * local_heads, (rank + 1) * local_heads
        self.geometry = BlockGeometry(layers, local_heads * tp, bs, dim, _dtype_name(pool.dtype))
        self.block_shape = self.geometry.shape  # (2, L, H, bs, D)
        self.ctx, self.done_address, self.tp = ctx, done_address, tp
        # the TE's storage NIC: every rank books its share of each block it reads
        self.bucket = TokenBucket(None if storage_read_gbps is None
                                  else storage_read_gbps * 1e9 / tp)
        self._host: tuple[str, object, torch.Tensor] | None = None  # name, shm, slots view
        self._host_lock = threading.Lock()
        self.die_in_stage = False  # drill (stage-die): exit 13 after a stage's first block
        self.streams = None
        if stream is not None and rank == 0:
            bind, max_bytes, ttl_s = stream
            self.streams = LayerStreamServer(bind, ctx, max_bytes=max_bytes, ttl_s=ttl_s)
        self.layers = LayerLoads(pool, self.geometry, self.bucket, self._load_host, ctx,
                                 self.streams)
        self._priming: dict[int, LayerLoad] = {}  # op id -> its load, until primed
        self.num_done = 0
        # two threads: copies in memory never queue behind storage reads (the bucket)
        self._queues = {name: queue.SimpleQueue() for name in ("memory", "storage")}
        self._threads = [threading.Thread(target=self._loop, args=(q,), daemon=True,
                                          name=f"cache-{name}")
                         for name, q in self._queues.items()]
        for t in self._threads:
            t.start()

    def submit(self, ops: list[CacheOp]) -> None:
        """On the worker's main thread, before the batch's forward: a layered
        load is on the book (or off it) before any forward can look for it."""
        for op in ops:
            if op.kind == DROP_LAYERS:
                self.layers.drop(op.seq_id)
                continue
            if op.kind == DROP_STREAM:
                if self.streams is not None:
                    self.streams.drop(op.seq_id)
                continue
            if op.kind == LOAD_LAYERS and self._is_valid(op):  # else it fails in run()
                self._priming[op.op_id] = self.layers.open(op)
            disk = op.kind in (LOAD_DISK, STAGE_DISK, LOAD_LAYERS, STAGE_STREAM)
            self._queues["storage" if disk else "memory"].put(op)

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        self.layers.close()
        for t in self._threads:
            t.join(5)
        if self.streams is not None:
            self.streams.close()
        self._detach()

    # -- the threads -------------------------------------------------------------------
    def _loop(self, jobs: queue.SimpleQueue) -> None:
        out = PushSocket(self.ctx, self.done_address, bind=False)  # this thread's own
        try:
            while (op := jobs.get()) is not None:
                msg = self.run(op)
                try:
                    out.put(msg, timeout=5)
                except TimeoutError:
                    log.warning("cache op %d: the master does not listen", op.op_id)
        finally:
            out.close()

    def run(self, op: CacheOp) -> CacheOpsDone:
        started = time.perf_counter()
        num_ok, error, corrupt = 0, None, []
        try:
            self._check(op)
            if op.kind == LOAD_HOST:
                num_ok = self._load_host(op)
            elif op.kind == STORE_HOST:
                num_ok = self._store_host(op)
            elif op.kind == LOAD_DISK:
                num_ok, error, corrupt = self._load_disk(op)
            elif op.kind == STAGE_DISK:
                num_ok, error, corrupt = self._stage(op)
            elif op.kind == STAGE_STREAM:
                num_ok, error, corrupt = self._stage_stream(op)
            elif op.kind == LOAD_LAYERS:
                load = self._priming.pop(op.op_id)  # opened by submit() once _check passed
                num_ok, error, corrupt = load.prime(), load.prime_error, load.corrupt
            else:
                error = f"unknown cache op {op.kind!r}"
        except (OSError, ValueError, RuntimeError, IndexError) as e:  # this op fails alone
            error = f"{type(e).__name__}: {e}"
            log.warning("cache op %d (%s) failed: %s", op.op_id, op.kind, error)
        self.num_done += 1
        per_block = block_file.block_nbytes(self.geometry) // self.tp  # this rank's heads
        if op.kind in (STAGE_DISK, STAGE_STREAM):  # whole blocks, by rank 0 alone
            per_block = self.tp * per_block if self.rank == 0 else 0
        nbytes = num_ok * per_block
        if op.kind == LOAD_LAYERS:  # its disk blocks, read now and during the forward
            nbytes = sum(1 for s in op.slots[:num_ok] if s == ON_DISK) * per_block
        stream = self.streams.address if op.kind == STAGE_STREAM and self.streams else ""
        return CacheOpsDone(rank=self.rank, op_id=op.op_id, num_ok=num_ok, nbytes=nbytes,
                            seconds=time.perf_counter() - started, error=error,
                            corrupt=corrupt, stream=stream)

    def _is_valid(self, op: CacheOp) -> bool:
        try:
            self._check(op)
        except ValueError:
            return False
        return True

    def _check(self, op: CacheOp) -> None:
        if any(not 0 <= b < self.num_blocks for b in op.block_ids):
            raise ValueError(f"device block id out of range [0, {self.num_blocks})")
        n = len(op.block_ids)
        if op.kind in (STAGE_DISK, STAGE_STREAM):
            n = len(op.hashes)
        if op.kind in (LOAD_HOST, STORE_HOST, STAGE_DISK) and len(op.slots) != n:
            raise ValueError(f"{len(op.slots)} slots for {n} blocks")
        if op.kind in (LOAD_DISK, LOAD_LAYERS) and len(op.hashes) != n:
            raise ValueError(f"{len(op.hashes)} hashes for {n} blocks")
        if op.kind == LOAD_LAYERS and (self.tp != 1 or len(op.slots) != n):
            raise ValueError("a layered load needs tp 1 and a slot (or ON_DISK) per block")
        if op.kind == LOAD_LAYERS and len(op.stream_rows) != op.slots.count(ON_STREAM):
            raise ValueError(f"{len(op.stream_rows)} stream rows for "
                             f"{op.slots.count(ON_STREAM)} stream blocks")

    def _slots(self, segment: str) -> torch.Tensor:
        """The host pool as (num_slots, 2, L, H, bs, D), attached once per name."""
        with self._host_lock:
            return self._attached(segment)

    def _attached(self, segment: str) -> torch.Tensor:
        if self._host is None or self._host[0] != segment:
            self._detach()
            shm = attach_segment(segment)
            flat = torch.frombuffer(shm.buf, dtype=self.pool.dtype)
            per_slot = int(torch.Size(self.block_shape).numel())
            if flat.numel() % per_slot:
                shm.close()
                raise ValueError(f"host pool {segment} does not hold whole blocks of this model")
            self._host = (segment, shm, flat.view(-1, *self.block_shape))
        return self._host[2]

    def _detach(self) -> None:
        if self._host is not None:
            _, shm, _ = self._host
            self._host = None
            try:
                shm.close()
            except BufferError:
                pass  # a view is still referenced: the mapping goes with the process

    def _load_host(self, op: CacheOp) -> int:
        host_to_pool(self.pool, self._slots(op.segment), op.slots, op.block_ids, self.h0,
                     self.h1)
        return len(op.block_ids)

    def _store_host(self, op: CacheOp) -> int:
        slots = self._slots(op.segment)
        s = torch.tensor(op.slots, dtype=torch.long)
        b = torch.tensor(op.block_ids, dtype=torch.long)
        src = self.pool.index_select(3, b).permute(3, 0, 1, 2, 4, 5)  # (n, 2, L, Hl, bs, D)
        slots[:, :, :, self.h0:self.h1].index_copy_(0, s, src)
        return len(op.block_ids)

    def _read(self, op: CacheOp, h: int, out, share: int) -> tuple[str, list[int]] | None:
        """One block file into `out`, through the storage bucket (share: the
        bytes this rank books); (why, corrupt hashes) when it cannot."""
        time.sleep(self.bucket.reserve(share))
        try:
            block_file.read_block(op.disk_dir, h, self.geometry, memoryview(out))
        except FileNotFoundError:
            return f"block file {block_file.hash_name(h)} is gone", []
        except block_file.BlockCorrupt as e:
            return f"corrupt: {e}", [h]
        return None

    def _load_disk(self, op: CacheOp) -> tuple[int, str | None, list[int]]:
        nbytes = block_file.block_nbytes(self.geometry)
        buf = bytearray(nbytes)
        block = torch.frombuffer(buf, dtype=self.pool.dtype).view(self.block_shape)
        for i, (h, b) in enumerate(zip(op.hashes, op.block_ids)):
            failed = self._read(op, h, buf, nbytes // self.tp)
            if failed is not None:
                return i, *failed
            self.pool[:, :, :, b].copy_(block[:, :, self.h0:self.h1])
        return len(op.block_ids), None, []

    def _read_blocks(self, op: CacheOp, hashes: list[int], views) -> tuple[int, tuple | None]:
        """Whole block files (every head: rank 0's) into views[i] in turn, through
        the storage bucket; how many landed, and (why, corrupt hashes) of the next."""
        nbytes = block_file.block_nbytes(self.geometry)
        for i, (h, out) in enumerate(zip(hashes, views)):
            failed = self._read(op, h, out, nbytes)
            if failed is not None:
                return i, failed
            if self.die_in_stage:  # as a decode TE that fails while it streams KV
                log.error("drill: stage-die after %d of %d blocks: exit 13", i + 1, len(hashes))
                os._exit(13)
        return len(hashes), None

    def _stage(self, op: CacheOp) -> tuple[int, str | None, list[int]]:
        """Block files -> host slots, by rank 0 (a slot holds every head)."""
        if self.rank != 0:
            return len(op.hashes), None, []
        slots = self._slots(op.segment)
        bad = next((i for i, s in enumerate(op.slots) if not 0 <= s < slots.shape[0]), None)
        n = len(op.hashes) if bad is None else bad
        ok, failed = self._read_blocks(op, op.hashes[:n], (
            slots[s].view(-1).view(torch.uint8).numpy() for s in op.slots[:n]))
        if failed is not None:
            return ok, *failed
        if bad is not None:
            return ok, f"host slot {op.slots[bad]} out of range", []
        return ok, None, []

    def _stage_stream(self, op: CacheOp) -> tuple[int, str | None, list[int]]:
        """Block files -> a buffer served as layer stream op.seq_id, by rank 0
        (it holds every head); as many leading blocks as the buffer has room for."""
        if self.rank != 0:
            return len(op.hashes), None, []
        if self.streams is None:
            return 0, "this worker serves no layer streams", []
        n = min(len(op.hashes), self.streams.room(block_file.block_nbytes(self.geometry)))
        blocks = torch.empty((n, *self.block_shape), dtype=self.pool.dtype)
        ok, failed = self._read_blocks(op, op.hashes[:n], (
            b.view(-1).view(torch.uint8).numpy() for b in blocks))
        if ok:
            self.streams.put(op.seq_id, blocks[:ok])
        if failed is not None:
            return ok, *failed
        if n < len(op.hashes):
            return n, f"stream buffer full: {n} of {len(op.hashes)} blocks", []
        return n, None, []
