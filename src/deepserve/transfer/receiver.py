"""DistFlowReceiver: the destination side of the tcp and ring backends.

    senders' DEALERs ---> ROUTER (bound: 127.0.0.1, or the host's address across hosts)
                            |  one daemon thread owns the socket:
                            |  Hello -> Welcome; Push -> write rows -> Ack;
                            |  RingChunk -> copy from the sender's staging
                            v  segment -> Ack; Bye -> detach that segment
                          pool (2, L, H, NB, bs, D)

Bytes arrive in canonical order (layout.py) and are scattered into the pool
rows of the destination region. Every request is validated first (region in
range, byte count, whole rows); a Push whose data frames hold fewer (or more)
bytes than its header says is a short write: nothing is written and the Ack
says why. A ring transfer keeps a little state per (sender, tid) between its
chunks; chunks must arrive in order, and the last one checks that every row
was written. With `want_checksum` the final Ack carries the crc32 of the
destination bytes read back from the pool.

The receiver never owns a staging segment: each RingLink creates its own and
unlinks it; the receiver only attaches (and detaches on Bye or close).
"""

from __future__ import annotations

import logging
import shutil
import threading
from multiprocessing.shared_memory import SharedMemory

import msgspec
import torch
import zmq

from deepserve.config.cluster import is_loopback
from deepserve.ipc.segments import attach_segment
from deepserve.ipc.sockets import LOCAL, bind_listener, ipc_address
from deepserve.transfer import layout
from deepserve.transfer.types import PeerEndpoint, PoolRegion, TransferError
from deepserve.transfer.wire import Ack, Bye, Hello, Push, RingChunk, ToReceiver, Welcome

log = logging.getLogger(__name__)
POLL_MS = 50  # how often the loop looks at the stop flag
LOOPBACK = "tcp://127.0.0.1:0"
"""A loopback TCP bind (tests that mean tcp); a node's one-host receivers bind LOCAL."""
WILDCARDS = ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:")


def kv_bind(host: str, run_dir: str = "", name: str = "kv") -> str:
    """Where a TE's KV listener `name` binds for kv_bind_host `host`: on a
    loopback host, which only this host's peers use, ipc:// in the TE's run
    directory (0700; LOCAL without one); else tcp on the host's own address
    (CURVE with [cluster] secure), for peers on other hosts."""
    if not is_loopback(host):
        return f"tcp://{host}:0"
    return ipc_address(run_dir, name) if run_dir else LOCAL


class _RingState(msgspec.Struct):
    idx: torch.Tensor  # destination pool row of every canonical row
    nbytes: int
    want_checksum: bool
    rows_done: int = 0


class DistFlowReceiver:
    """The destination side for the tcp and ring backends: a thread that writes incoming blocks into its pool and acknowledges each transfer (with the checksum of the bytes it wrote when asked)."""

    def __init__(self, pool: torch.Tensor, *, bind: str = LOCAL,
                 ctx: zmq.Context | None = None):
        """`bind`: LOCAL (ipc:// in a directory only this user enters) serves senders
        on this host; senders on other hosts need this host's own address (e.g.
        "tcp://10.0.0.5:0"). Never a wildcard: the endpoint advertises the bound
        address, and "0.0.0.0" reaches no peer."""
        if bind.startswith(WILDCARDS):
            raise ValueError(f"bind {bind!r}: name this host's address, not a wildcard")
        layout.check_pool(pool)
        self.pool = pool
        self._rows = layout.rows_view(pool)  # (R, E)
        self._shape = tuple(pool.shape)
        self._dtype = layout.dtype_name(pool.dtype)
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address, self._dir = bind_listener(self._sock, bind, "ds-df-")  # _dir: LOCAL's
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToReceiver)
        self._staging: dict[str, tuple[SharedMemory, torch.Tensor]] = {}
        self._rings: dict[tuple[bytes, int], _RingState] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distflow-recv", daemon=True)
        self._thread.start()

    def endpoint(self, shm_name: str | None = None) -> PeerEndpoint:
        """How senders reach this pool: tcp = our bound address, shm = `shm_name` if given."""
        return PeerEndpoint(shape=self._shape, dtype=self._dtype, shm=shm_name, tcp=self.address)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- the loop (the only user of the socket) -----------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(POLL_MS, zmq.POLLIN):
                    continue
                ident, head, *data = self._sock.recv_multipart(copy=False)
                reply = self._handle(ident.bytes, head.bytes, data)
                if reply is not None:
                    self._sock.send_multipart([ident, self._enc.encode(reply)])
        finally:
            self._sock.close(linger=0)
            for name in list(self._staging):
                self._detach(name)
            self._rings.clear()

    def _handle(self, ident: bytes, head: bytes, data: list[zmq.Frame]):
        try:
            msg = self._dec.decode(head)
        except msgspec.DecodeError as e:
            log.warning("dropping an undecodable DistFlow message: %s", e)
            return None
        if isinstance(msg, Hello):
            return Welcome(self._shape, self._dtype)
        if isinstance(msg, Bye):
            self._detach(msg.staging)
            return None
        try:
            if isinstance(msg, Push):
                return self._push(msg, data)
            return self._ring_chunk(ident, msg)
        except Exception as e:  # bad region, short write, missing staging, ...
            if isinstance(msg, RingChunk):
                self._rings.pop((ident, msg.tid), None)
            return Ack(msg.tid, ok=False, seq=getattr(msg, "seq", 0), error=str(e))

    def _region_rows(self, ids: list[int], layers: tuple[int, int], nbytes: int) -> torch.Tensor:
        span = layout.layer_range(PoolRegion(ids, tuple(layers)), self._shape[1])
        layout.check_ids(ids, self._shape[3], "destination", unique=True)
        idx = layout.row_index(self._shape, ids, span)
        expected = idx.numel() * self._row_bytes()
        if nbytes != expected:
            raise TransferError(f"header says {nbytes} bytes, the region holds {expected}")
        return idx

    def _row_bytes(self) -> int:
        return self._rows.shape[1] * self._rows.element_size()

    def _push(self, msg: Push, data: list[zmq.Frame]) -> Ack:
        idx = self._region_rows(msg.block_ids, msg.layers, msg.nbytes)
        got = sum(len(f) for f in data)
        if got != msg.nbytes or any(len(f) % self._row_bytes() for f in data):
            raise TransferError(f"short write: {got} bytes in {len(data)} frames, header "
                                f"says {msg.nbytes} in whole rows of {self._row_bytes()}")
        r = 0
        for frame in data:
            if not len(frame):
                continue
            src = torch.frombuffer(frame.buffer, dtype=self.pool.dtype).view(-1, self._rows.shape[1])
            layout.scatter_rows(self._rows, idx[r:r + src.shape[0]], src)
            r += src.shape[0]
        crc = layout.checksum_rows(self._rows, idx) if msg.want_checksum else None
        return Ack(msg.tid, ok=True, nbytes=got, checksum=crc)

    def _ring_chunk(self, ident: bytes, msg: RingChunk) -> Ack:
        key = (ident, msg.tid)
        if msg.seq == 0:  # a new transfer from this sender ends any older one
            for old in [k for k in self._rings if k[0] == ident]:
                del self._rings[old]
            idx = self._region_rows(msg.block_ids, msg.layers, msg.nbytes)
            self._rings[key] = _RingState(idx, msg.nbytes, msg.want_checksum)
        state = self._rings.get(key)
        if state is None:
            raise TransferError(f"chunk {msg.seq} of unknown transfer {msg.tid}")
        if msg.row0 != state.rows_done or msg.row0 + msg.num_rows > state.idx.numel():
            raise TransferError(f"chunk {msg.seq} rows [{msg.row0}, +{msg.num_rows}) out of order "
                                f"or past the region ({state.rows_done} of {state.idx.numel()} done)")
        src = self._staging_rows(msg.staging, msg.slot_offset, msg.num_rows)
        layout.scatter_rows(self._rows, state.idx[msg.row0:msg.row0 + msg.num_rows], src)
        state.rows_done += msg.num_rows
        nbytes = state.rows_done * self._row_bytes()
        if not msg.last:
            return Ack(msg.tid, ok=True, nbytes=nbytes, seq=msg.seq)
        del self._rings[key]
        if state.rows_done != state.idx.numel():
            raise TransferError(f"short write: {nbytes} of {state.nbytes} bytes before the last chunk")
        crc = layout.checksum_rows(self._rows, state.idx) if state.want_checksum else None
        return Ack(msg.tid, ok=True, nbytes=nbytes, seq=msg.seq, checksum=crc)

    def _staging_rows(self, name: str, offset: int, num_rows: int) -> torch.Tensor:
        if name not in self._staging:
            try:
                seg = attach_segment(name)
            except (OSError, ValueError) as e:
                raise TransferError(f"cannot attach staging segment {name!r}: {e}") from e
            self._staging[name] = (seg, torch.frombuffer(seg.buf, dtype=torch.uint8))
        raw = self._staging[name][1]
        size = num_rows * self._row_bytes()
        if offset < 0 or offset % self._row_bytes() or offset + size > raw.numel():
            raise TransferError(f"chunk [{offset}, +{size}) outside staging {name!r}")
        return raw[offset:offset + size].view(self.pool.dtype).view(num_rows, -1)

    def _detach(self, name: str) -> None:
        entry = self._staging.pop(name, None)
        if entry is None:
            return
        seg, view = entry
        del view, entry
        try:
            seg.close()
        except BufferError:  # a view is still referenced somewhere; GC unmaps it
            pass
