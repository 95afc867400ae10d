"""Layer-wise KV loads (CacheOp load_layers): a hit read from storage a layer at a time.

Each layer goes through a ring of a few layers into the pool just before that
layer computes, so the reads of the next layers overlap the compute of this
one (DualPath's layer-wise prefill; tp 1).

  master ──load_layers──> LayerLoads.open (the worker's main thread): a LayerLoad
      storage thread, prime(): open every block file (header, trailer: a file
          removed later is still read through its descriptor), copy the host
          hits whole, read layers 0..S-1 of the disk hits into the ring (and
          pull those of the stream hits: ON_STREAM rows, served by the decode
          TE that read them from its storage, transfer/layer_stream.py)
          ──CacheOpsDone(num_ok: the leading blocks it could get)──> master,
          which queues the request with those blocks as its own
  that sequence's next forward (ModelRunner.execute):
      begin(): a reader thread for layers S..L-1, through the storage bucket,
          each into the ring slot its layer j - S freed
      before layer j: wait for layer j, copy its slot into the pool, free it
      end(): a read that failed after the prime (a layer's checksum) leaves
          the sequence without its KV: LoadLost, it is not sampled, and the
          master frees it uncommitted and the request is retried

A forward waiting on a layer is progress for the supervisor (num_waits, a
beat every WAIT_SLICE_S), bounded by the layer's timeout: past it the load is
lost, never a hang. Staging memory is S layers of the load's disk and stream blocks
(S = CacheOp.layers),
`staged_bytes`; the pool blocks written are the sequence's own (committed to
the prefix tree only after its step), so no other step reads them half-loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch
import zmq

from deepserve.messages.cache import LOAD_HOST, ON_DISK, ON_STREAM, CacheOp
from deepserve.messages.step import LoadLost
from deepserve.tiers import block_file
from deepserve.tiers.token_bucket import TokenBucket
from deepserve.transfer.layer_stream import LayerStreamClient, LayerStreamServer
from deepserve.transfer.types import TransferError

log = logging.getLogger(__name__)

LAYER_TIMEOUT_S = 10.0  # a forward waits this long for one layer (or 4x its time at the
# bucket's rate, if longer), then the load is lost
WAIT_SLICE_S = 0.5  # while it waits, on_wait() every this often (the worker beats)


class LayerLoad:
    """One load_layers op: S ring slots of (2, n, H, bs, D), n its disk and stream blocks."""

    def __init__(self, op: CacheOp, pool: torch.Tensor, geometry, bucket: TokenBucket,
                 load_host: Callable[[CacheOp], int], on_wait: Callable[[], None],
                 ctx: zmq.Context | None = None, own: LayerStreamServer | None = None):
        """load_host: the cache executor's copy of a load_host op (host hits);
        ctx: for the stream's socket (ON_STREAM rows); own: this worker's stream
        server, whose streams (its PE buffer) are read in place, not over tcp."""
        self.op, self.pool, self.geometry, self.bucket = op, pool, geometry, bucket
        self.load_host, self.on_wait, self.ctx = load_host, on_wait, ctx
        self.own = own if own is not None and op.stream == own.address else None
        self.num_layers = geometry.num_layers
        self.depth = max(1, min(op.layers, self.num_layers))
        self.disk = [i for i, s in enumerate(op.slots) if s in (ON_DISK, ON_STREAM)]
        _, _, heads, _, bs, dim = pool.shape
        self.ring = torch.empty((self.depth, 2, len(self.disk), heads, bs, dim),
                                dtype=pool.dtype)
        # per ring row (self.disk): its open block file, or its row of the stream
        self.sources: list[block_file.LayerFile | int] = []
        self.stream: LayerStreamClient | None = None
        self.num_ok = 0  # leading blocks (of op.block_ids) the load brings
        self.corrupt: list[int] = []
        self.prime_error: str | None = None  # why the load ends before its last block
        self.error: str | None = None  # a read after the prime failed: the load is lost
        self.read = 0  # layers read into the ring
        self.taken = 0  # layers copied into the pool
        self.primed = self.closed = False
        self.cond = threading.Condition()
        self.reader: threading.Thread | None = None
        layer_bytes = 2 * block_file.layer_nbytes(geometry) * self._num_files()
        self.layer_timeout_s = max(LAYER_TIMEOUT_S, 4 * layer_bytes / bucket.rate
                                   if bucket.rate else 0.0)

    @property
    def staged_bytes(self) -> int:
        return self.ring.numel() * self.ring.element_size()

    # -- the storage thread -----------------------------------------------------------
    def prime(self) -> int:
        """Open, copy the host hits, read the first S layers; the blocks it got."""
        try:
            n = 0 if self.closed else self._open()  # dropped before its turn: nothing
            self._copy_host(n)
            self._trim(n)
            for j in range(min(self.depth, self.num_layers)):
                self._read_layer(j)
        finally:
            with self.cond:
                self.primed = True
                self.cond.notify_all()
                if self.closed:  # dropped while priming: its files close here, not under it
                    self._close_files()
        return self.num_ok

    @property
    def files(self) -> list[block_file.LayerFile]:
        return [f for f in self.sources if isinstance(f, block_file.LayerFile)]

    def _num_files(self) -> int:
        return sum(1 for i in self.disk if self.op.slots[i] == ON_DISK)

    def _open(self) -> int:
        """Every disk block's file, in block order, up to the first it cannot open."""
        stream_rows = iter(self.op.stream_rows)
        for i in range(len(self.op.block_ids)):
            if self.op.slots[i] == ON_STREAM:
                self.sources.append(next(stream_rows))
            if self.op.slots[i] != ON_DISK:
                continue
            try:
                self.sources.append(block_file.LayerFile(self.op.disk_dir, self.op.hashes[i],
                                                         self.geometry))
            except OSError as e:  # FileNotFoundError: evicted meanwhile
                self.prime_error = f"block file {block_file.hash_name(self.op.hashes[i])}: {e}"
                return i
            except block_file.NoLayerIndex as e:
                self.prime_error = str(e)
                return i
            except block_file.BlockCorrupt as e:
                self.prime_error, self.corrupt = f"corrupt: {e}", [self.op.hashes[i]]
                return i
        return len(self.op.block_ids)

    def _copy_host(self, n: int) -> None:
        """Host hits go whole, now: the tier's lease ends with the prime."""
        rows = [i for i in range(n) if self.op.slots[i] not in (ON_DISK, ON_STREAM)]
        if not rows:
            return
        with self.cond:
            if not self.closed:
                self.load_host(CacheOp(self.op.op_id, LOAD_HOST,
                                       [self.op.block_ids[i] for i in rows],
                                       slots=[self.op.slots[i] for i in rows],
                                       segment=self.op.segment))

    def _trim(self, n: int) -> None:
        """The load now covers its first n blocks: ring rows past them go."""
        self.num_ok = n
        keep = sum(1 for i in self.disk if i < n)
        for f in self.sources[keep:]:
            if isinstance(f, block_file.LayerFile):
                f.close()
        del self.sources[keep:]
        self.disk = self.disk[:keep]

    def _read_layer(self, j: int) -> bool:
        """Layer j of every disk and stream block into its slot. A block that
        fails while priming ends the load before it (the rows kept have this
        layer); after the prime, False: the load is lost."""
        if self._num_files():
            time.sleep(self.bucket.reserve(2 * block_file.layer_nbytes(self.geometry)
                                           * self._num_files()))
        slot = self.ring[j % self.depth]
        sources = list(self.sources)
        pulled = self._pull(j, [f for f in sources if isinstance(f, int)])
        streamed = 0
        for row, f in enumerate(sources):
            if self.closed:
                return False
            try:
                if isinstance(f, int):  # the stream's block: pulled above
                    if isinstance(pulled, Exception):
                        raise pulled
                    slot[:, row].copy_(pulled[streamed])
                    streamed += 1
                    continue
                k = slot[0, row].view(-1).view(torch.uint8).numpy()
                v = slot[1, row].view(-1).view(torch.uint8).numpy()
                f.read_layer(j, memoryview(k), memoryview(v))
            except (OSError, block_file.BlockCorrupt, TransferError) as e:
                if not self._failed(j, row, e):
                    return False
                break
        with self.cond:
            self.read = j + 1
            self.cond.notify_all()
        return True

    def _pull(self, j: int, rows: list[int]) -> torch.Tensor | TransferError | None:
        """Layer j of these stream rows, (n, 2, H, bs, D), or why not."""
        if not rows:
            return None
        try:
            if self.own is not None:  # read ahead by this worker: no socket
                got = self.own.layer(self.op.stream_id, j, rows)
            else:
                if self.stream is None:  # on the storage thread (prime), then the reader's
                    self.stream = LayerStreamClient(self.op.stream,
                                                    self.ctx or zmq.Context.instance(),
                                                    LAYER_TIMEOUT_S)
                got = self.stream.pull(self.op.stream_id, j, rows)
        except (TransferError, zmq.ZMQError, KeyError, IndexError) as e:
            return TransferError(str(e))
        if tuple(got.shape) != (len(rows), 2, *self.ring.shape[3:]):
            return TransferError(f"stream layer of shape {tuple(got.shape)}, not "
                                 f"({len(rows)}, 2, {', '.join(map(str, self.ring.shape[3:]))})")
        return got.to(self.ring.dtype)

    def _failed(self, j: int, row: int, e: Exception) -> bool:
        """True: still priming, the load now ends before this block."""
        h = self.op.hashes[self.disk[row]]  # 0 for a stream's block
        with self.cond:
            if isinstance(e, block_file.BlockCorrupt):
                self.corrupt.append(h)
            if not self.primed:
                self.prime_error = f"layer {j}: {e}"
                self._trim(self.disk[row])
                return True
            name = block_file.hash_name(h) if h else f"{self.op.stream}#{self.op.stream_id}"
            self.error = f"layer {j} of block {name}: {e}"
            self.cond.notify_all()
            return False

    # -- the forward's thread ------------------------------------------------------------
    def begin(self) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.primed or self.closed, LAYER_TIMEOUT_S):
                self.error = f"not primed in {LAYER_TIMEOUT_S} s"
        if self.disk and self.depth < self.num_layers and self.error is None:
            self.reader = threading.Thread(target=self._read_rest, daemon=True,
                                           name=f"layers-{self.op.seq_id}")
            self.reader.start()

    def _read_rest(self) -> None:
        for j in range(self.depth, self.num_layers):
            with self.cond:  # layer j - depth's slot must be in the pool first
                self.cond.wait_for(lambda: self.taken > j - self.depth or self.closed)
                if self.closed:
                    return
            if not self._read_layer(j):
                return

    def before_layer(self, j: int) -> None:
        """Copy layer j in (waiting for its read): each layer read before a
        failure, none after it."""
        if not self.num_ok or not self.disk:
            return
        deadline = time.monotonic() + self.layer_timeout_s
        with self.cond:
            while not self.cond.wait_for(lambda: self.read > j or self.error is not None,
                                         WAIT_SLICE_S):
                if time.monotonic() > deadline:
                    self.error = f"layer {j} not read in {self.layer_timeout_s:.1f} s"
                    break
                self.on_wait()  # a bounded wait on storage, not a hang
            if self.read <= j:  # failed before it
                return
        rows = torch.tensor([self.op.block_ids[i] for i in self.disk], dtype=torch.long)
        slot = self.ring[j % self.depth, :, :len(self.disk)]  # (2, n, H, bs, D): kept rows
        for kv in (0, 1):
            self.pool[kv, j].index_copy_(1, rows, slot[kv].permute(1, 0, 2, 3))
        with self.cond:
            self.taken = j + 1
            self.cond.notify_all()

    def consumed(self) -> None:
        """Its forward is done: a stream of this worker's own is not needed again
        (a decode TE's stream is dropped by that TE when the KV reaches it)."""
        if self.own is not None:
            self.own.drop(self.op.stream_id)

    def lost(self) -> LoadLost | None:
        """After the forward: what it could not bring (None: all of it)."""
        if self.error is None or not self.num_ok:
            return None
        return LoadLost(self.op.seq_id, self.error, list(self.corrupt))

    def close(self) -> None:
        """Off: no more reads. Its files close once no thread reads them (a
        descriptor closed under a read could be reused by another open)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            primed = self.primed
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(LAYER_TIMEOUT_S)
        if primed:
            self._close_files()

    def _close_files(self) -> None:
        for f in self.files:
            f.close()
        if self.stream is not None:
            self.stream.close()


class LayerLoads:
    """The worker's layered loads by sequence id: opened by a batch's ops,
    primed on the storage thread, consumed by that sequence's next forward."""

    def __init__(self, pool: torch.Tensor, geometry, bucket: TokenBucket,
                 load_host: Callable[[CacheOp], int], ctx: zmq.Context | None = None,
                 own: LayerStreamServer | None = None):
        self.pool, self.geometry, self.bucket, self.load_host = pool, geometry, bucket, \
            load_host
        self.ctx, self.own = ctx, own  # for the loads' streams: sockets; this worker's
        self.loads: dict[int, LayerLoad] = {}
        self.lock = threading.Lock()
        self.num_waits = 0  # WAIT_SLICE_S slices a forward waited on a layer: progress
        self.beat: Callable[[], None] = lambda: None  # the worker's heartbeat, if any

    def _on_wait(self) -> None:
        self.num_waits += 1
        self.beat()

    def open(self, op: CacheOp) -> LayerLoad:
        load = LayerLoad(op, self.pool, self.geometry, self.bucket, self.load_host,
                         self._on_wait, self.ctx, self.own)
        with self.lock:
            old, self.loads[op.seq_id] = self.loads.get(op.seq_id), load
        if old is not None:
            old.close()
        return load

    def drop(self, seq_id: int) -> None:
        with self.lock:
            load = self.loads.pop(seq_id, None)
        if load is not None:
            load.close()

    def take(self, seq_ids) -> list[LayerLoad]:
        """The loads of these sequences, off the book: this forward's."""
        with self.lock:
            return [self.loads.pop(s) for s in seq_ids if s in self.loads]

    def forward(self, seqs) -> "LayerForward | None":
        """The loads of this forward's sequences (ScheduledSeq), begun; None
        (at once, on the step loop) when no load is on the book."""
        if not self.loads:
            return None
        loads = self.take(s.seq_id for s in seqs)
        if not loads:
            return None
        for load in loads:
            load.begin()
        return LayerForward(loads)

    def close(self) -> None:
        with self.lock:
            loads, self.loads = list(self.loads.values()), {}
        for load in loads:
            load.close()


class LayerForward:
    """One forward's layered loads: before_layer(j) for the model, end() after."""

    def __init__(self, loads: list[LayerLoad]):
        self.loads = loads

    def before_layer(self, j: int) -> None:
        for load in self.loads:
            load.before_layer(j)

    def end(self) -> list[LoadLost]:
        lost = [x for x in (load.lost() for load in self.loads) if x is not None]
        for load in self.loads:
            load.close()
            load.consumed()
        for x in lost:
            log.warning("layered load of seq %d lost: %s", x.seq_id, x.message)
        return lost
