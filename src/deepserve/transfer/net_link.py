"""TcpLink and RingLink: transfers acknowledged by a DistFlowReceiver.

    sender thread (holds link.lock)              receiver thread
    DEALER --- Push + data frames ------------>  ROUTER: write rows, crc
           <-- Ack(tid, ok, nbytes, crc) ------
    (ring) staging segment, 2 slots <-- attach -- RingChunk names slot + rows

tcp: data frames are contiguous slices of our pool sent with copy=False
(zero-copy: zmq reads the pool memory itself), one per (kv, layer, head, run
of consecutive ids), adjacent slices merged. When that would make many small
frames (scattered ids) the rows are packed into one tensor first. The pool
outlives the socket, so frames zmq still holds after a timeout stay valid.

ring (same node, destination not mapped here): the link owns a staging
segment of two slots. Chunk i is gathered into slot i % 2 and announced with
a RingChunk; before reusing a slot the sender waits for the ack of chunk
i - 2, so the receiver copies one slot while the sender fills the other.

Timeouts: every blocking step (queueing a message, waiting for an ack)
waits at most `timeout_s`. The DEALER sets IMMEDIATE, so nothing queues for a
receiver that is gone: a dead peer is a TransferError, never a hang. Acks of
earlier transfers that timed out are recognised by tid and dropped.
"""

from __future__ import annotations

import threading
import time
import uuid

import msgspec
import torch
import zmq

from deepserve.ipc import curve
from deepserve.ipc.segments import create_segment, unlink_segment
from deepserve.transfer import layout
from deepserve.transfer.types import PeerEndpoint, TransferError
from deepserve.transfer.wire import Ack, Bye, Hello, Push, RingChunk, ToSender, Welcome

MAX_ZERO_COPY_FRAMES = 1024
MIN_FRAME_BYTES = 16 << 10  # smaller average frames: pack instead


class TcpLink:
    backend = "tcp"

    def __init__(self, pool: torch.Tensor, endpoint: PeerEndpoint, ctx: zmq.Context,
                 timeout_s: float):
        if not endpoint.tcp:
            raise TransferError(f"{self.backend} backend needs endpoint.tcp")
        self.pool, self.timeout_s, self.address = pool, timeout_s, endpoint.tcp
        self.peer_shape = tuple(endpoint.shape)
        self.lock = threading.Lock()  # one transfer at a time owns the socket
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToSender)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        try:
            curve.secure(self._sock, endpoint.tcp, bind=False)
            self._sock.connect(endpoint.tcp)
            self._hello(endpoint)
        except BaseException:
            self._sock.close(linger=0)
            raise

    def _hello(self, endpoint: PeerEndpoint) -> None:
        deadline = time.monotonic() + self.timeout_s
        self._send([self._enc.encode(Hello(dtype=endpoint.dtype))], deadline)
        reply = self._recv(deadline, lambda m: isinstance(m, Welcome))
        if tuple(reply.shape) != self.peer_shape or reply.dtype != endpoint.dtype:
            raise TransferError(f"receiver at {self.address} has a {tuple(reply.shape)} "
                                f"{reply.dtype} pool, endpoint says {endpoint.shape} {endpoint.dtype}")

    def run(self, tid: int, src_ids: list[int], dst_ids: list[int], layers: tuple[int, int],
            want_checksum: bool) -> int | None:
        idx = layout.row_index(tuple(self.pool.shape), src_ids, layers)
        nbytes = idx.numel() * self._row_bytes()
        crc = layout.checksum_rows(layout.rows_view(self.pool), idx) if want_checksum else None
        frames = self._data_frames(src_ids, layers, idx)
        head = self._enc.encode(Push(tid, dst_ids, layers, nbytes, want_checksum))
        with self.lock:
            self._send([head, *frames], time.monotonic() + self.timeout_s)
            ack = self._wait_ack(tid, 0)
        return _check_final(ack, nbytes, crc)

    def close(self) -> None:
        """Close the socket once no transfer uses it (bounded by timeout_s)."""
        got = self.lock.acquire(timeout=self.timeout_s)
        self._sock.close(linger=0)
        if got:
            self.lock.release()

    # -- helpers -------------------------------------------------------------

    def _row_bytes(self) -> int:
        return self.pool.shape[4] * self.pool.shape[5] * self.pool.element_size()

    def _data_frames(self, src_ids: list[int], layers: tuple[int, int], idx: torch.Tensor) -> list:
        """Whole rows in canonical order: pool slices (zero-copy) or one packed tensor."""
        row_bytes, nb = self._row_bytes(), self.pool.shape[3]
        spans: list[list[int]] = []  # [byte offset, nbytes], merged when adjacent
        id_runs = layout.runs(src_ids, src_ids)
        for base in idx.view(-1, len(src_ids))[:, 0].tolist():  # row of j=0 per (k, l, h)
            plane = base - src_ids[0]  # row of block 0 in this (k, l, h)
            for s0, _, n in id_runs:
                off = (plane + s0) * row_bytes
                if spans and spans[-1][0] + spans[-1][1] == off:
                    spans[-1][1] += n * row_bytes
                else:
                    spans.append([off, n * row_bytes])
            if len(spans) > MAX_ZERO_COPY_FRAMES:
                break
        total = idx.numel() * row_bytes
        if len(spans) <= MAX_ZERO_COPY_FRAMES and total >= MIN_FRAME_BYTES * len(spans):
            raw = layout.as_bytes(self.pool)
            return [raw[off:off + size] for off, size in spans]
        packed = torch.empty((idx.numel(), self.pool.shape[4] * self.pool.shape[5]),
                             dtype=self.pool.dtype)
        layout.gather_rows(layout.rows_view(self.pool), idx, packed)
        return [layout.as_bytes(packed)]

    def _send(self, frames: list, deadline: float) -> None:
        """Queue one multipart message, or TransferError once the deadline passes."""
        wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self._sock.poll(wait_ms, zmq.POLLOUT):
            raise TransferError(f"peer {self.address} unreachable: cannot send within "
                                f"{self.timeout_s} s")
        last = len(frames) - 1
        for i, frame in enumerate(frames):  # after the first part zmq takes them all
            flags = zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0)
            self._sock.send(frame, flags=flags, copy=i == 0)

    def _recv(self, deadline: float, wanted) -> ToSender:
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                continue
            msg = self._dec.decode(self._sock.recv(zmq.NOBLOCK))
            if wanted(msg):
                return msg
        raise TransferError(f"no reply from {self.address} within {self.timeout_s} s")

    def _wait_ack(self, tid: int, seq: int) -> Ack:
        ack = self._recv(time.monotonic() + self.timeout_s,
                         lambda m: isinstance(m, Ack) and m.tid == tid and (m.seq == seq or not m.ok))
        if not ack.ok:
            raise TransferError(f"receiver {self.address}: {ack.error}")
        return ack


class RingLink(TcpLink):
    backend = "ring"

    def __init__(self, pool: torch.Tensor, endpoint: PeerEndpoint, ctx: zmq.Context,
                 timeout_s: float, ring_bytes: int):
        super().__init__(pool, endpoint, ctx, timeout_s)
        row_bytes = self._row_bytes()
        self.slot_rows = max(1, ring_bytes // 2 // row_bytes)
        self.staging = f"{endpoint.shm or 'deepserve-distflow'}-stg{uuid.uuid4().hex[:8]}"
        try:
            self._segment = create_segment(self.staging, 2 * self.slot_rows * row_bytes)
        except BaseException:
            super().close()
            raise
        rows = torch.frombuffer(self._segment.buf, dtype=pool.dtype,
                                count=2 * self.slot_rows * row_bytes // pool.element_size())
        self._slots = rows.view(2, self.slot_rows, -1)  # (2, slot_rows, E)

    def run(self, tid: int, src_ids: list[int], dst_ids: list[int], layers: tuple[int, int],
            want_checksum: bool) -> int | None:
        idx = layout.row_index(tuple(self.pool.shape), src_ids, layers)
        rows, num_rows, row_bytes = layout.rows_view(self.pool), idx.numel(), self._row_bytes()
        crc = layout.checksum_rows(rows, idx) if want_checksum else None
        starts = list(range(0, num_rows, self.slot_rows))
        with self.lock:
            for seq, r0 in enumerate(starts):
                if seq >= 2:  # slot seq % 2 is free once chunk seq - 2 is acked
                    self._wait_ack(tid, seq - 2)
                n = min(self.slot_rows, num_rows - r0)
                slot = seq % 2
                layout.gather_rows(rows, idx[r0:r0 + n], self._slots[slot, :n])
                chunk = RingChunk(tid, seq, self.staging, slot * self.slot_rows * row_bytes, r0, n,
                                  dst_ids if seq == 0 else [], layers, num_rows * row_bytes,
                                  want_checksum, last=seq == len(starts) - 1)
                self._send([self._enc.encode(chunk)], time.monotonic() + self.timeout_s)
            for seq in range(max(0, len(starts) - 2), len(starts)):
                ack = self._wait_ack(tid, seq)
        return _check_final(ack, num_rows * row_bytes, crc)

    def close(self) -> None:
        got = self.lock.acquire(timeout=self.timeout_s)
        try:
            if got:  # best effort: let the receiver drop its mapping
                self._sock.send(self._enc.encode(Bye(self.staging)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._sock.close(linger=100)  # time for the Bye to leave
        self._slots = None
        unlink_segment(self.staging)
        try:
            self._segment.close()
        except BufferError:
            pass
        if got:
            self.lock.release()


def _check_final(ack: Ack, nbytes: int, crc: int | None) -> int | None:
    if ack.nbytes != nbytes:
        raise TransferError(f"short write: receiver wrote {ack.nbytes} of {nbytes} bytes")
    if crc is not None and ack.checksum != crc:
        raise TransferError(f"checksum mismatch: sent {crc:#010x}, receiver has "
                            f"{ack.checksum if ack.checksum is None else hex(ack.checksum)}")
    return crc
