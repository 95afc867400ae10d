"""BroadcastRing: one writer, N reader processes, one shared-memory segment.

The master puts each step's inputs once; every worker reads the same bytes.
The segment holds a small ring header and `num_slots` fixed-size slots; all
header fields are native int64 words (8-byte aligned, so loads and stores of
one word are atomic on x86-64):

    offset 0: ring header (64 bytes)
    +-------+---------+-------------+-----------+------------+-------------+-----+
    | magic | version | num_readers | num_slots | slot_bytes | slot_stride | 0 0 |
    +-------+---------+-------------+-----------+------------+-------------+-----+
    offset 64 + i * slot_stride: slot i
    +-----+--------+-------------+-------------+-----+---------------+-----+------------+
    | seq | length | overflow_id | read_seq[0] | ... | read_seq[N-1] | pad | payload    |
    +-----+--------+-------------+-------------+-----+---------------+-----+------------+
      written by the writer ---->  by reader 0   ...   by reader N-1  (to 64) slot_bytes

Message k (k = 1, 2, ...) goes to slot (k - 1) % num_slots. `seq` is the
slot's "written" flag: the number of the message it holds (0 = never used).
`read_seq[r]` is reader r's "read" flag: the last message it finished there.
Every word has exactly one writing process. The writer may reuse a slot only
when every reader's read_seq has caught up with the slot's seq, so a slow
reader stalls the writer (until its timeout) but never loses a message.

Overflow: a message longer than `slot_bytes` goes as a ZeroMQ frame through
an `OverflowChannel` (one PUSH/PULL pair per reader, see overflow.py). The
writer sends the frame to every reader first, then publishes the slot with
length = -1 (OVERFLOW) and the frame's overflow_id, so ring order is kept. As
sockets use linger 0, the writer's `close` first waits (bounded) until every
reader has taken the last overflow message, which would otherwise be lost.

Memory order: on x86 (TSO) plain stores are seen in program order, which is
all this protocol needs; `_fence` (an uncontended lock round trip, i.e. an
atomic instruction) keeps the order explicit for weaker CPUs as well.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Callable

from deepserve.ipc.overflow import OverflowChannel
from deepserve.ipc.segments import (attach_segment, check_segment_name, create_segment,
                                    unlink_segment)

MAGIC = 0x42525344  # b"DSRB" little-endian
VERSION = 1
RING_HEADER_BYTES = 64
ALIGN = 64
OVERFLOW = -1  # `length` value: the payload is in a ZeroMQ frame
_SEQ, _LENGTH, _OVERFLOW_ID, _READ_SEQ0 = 0, 1, 2, 3  # slot header words

_NUM_BUSY_POLLS = 4000  # ~1 ms of pure spinning before yielding the CPU
_NUM_YIELDS = 100  # then time.sleep(0) this many times
_MAX_SLEEP_S = 1e-3  # then sleeps doubling from 10 us up to this
_FENCE_LOCK = threading.Lock()


class RingNotReady(ValueError):
    """The segment exists but its creator has not finished it: not yet sized,
    or its header not yet marked valid. A reader may retry."""


class BroadcastRing:
    """Single-writer, multi-reader ring; build with `create` or `attach`."""

    def __init__(self, shm: SharedMemory, reader_rank: int | None,
                 overflow_address: str | None):
        if shm.size < RING_HEADER_BYTES:
            raise RingNotReady(f"segment {shm.name!r} is not sized yet")
        header = shm.buf[:RING_HEADER_BYTES].cast("q")
        magic, version, num_readers, num_slots, slot_bytes, stride = header[:6]
        header.release()
        if magic == 0:
            raise RingNotReady(f"segment {shm.name!r}: its header is not written yet")
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"segment {shm.name!r} is not a BroadcastRing v{VERSION}")
        if reader_rank is not None and not 0 <= reader_rank < num_readers:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {num_readers})")
        self.name, self.reader_rank = shm.name, reader_rank
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.is_writer = reader_rank is None
        self._shm = shm
        self._overflow = None if overflow_address is None else OverflowChannel(
            overflow_address, list(range(num_readers)) if self.is_writer else [reader_rank],
            self.is_writer)
        header_bytes = _slot_header_bytes(num_readers)
        offsets = [RING_HEADER_BYTES + i * stride for i in range(num_slots)]
        self._headers = [shm.buf[o:o + header_bytes].cast("q") for o in offsets]
        self._payloads = [shm.buf[o + header_bytes:o + header_bytes + slot_bytes]
                          for o in offsets]
        self._next_seq = 1
        self._last_overflow_seq = 0
        self._is_closed = False

    @classmethod
    def create(cls, name: str, num_readers: int, slot_bytes: int = 1 << 20,
               num_slots: int = 8, overflow_address: str | None = None) -> BroadcastRing:
        """Writer side: create segment `name` (and bind the overflow sockets)."""
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError("num_readers, num_slots and slot_bytes must be >= 1")
        stride = _round_up(_slot_header_bytes(num_readers) + slot_bytes, ALIGN)
        shm = create_segment(name, RING_HEADER_BYTES + num_slots * stride)
        try:
            header = shm.buf[:RING_HEADER_BYTES].cast("q")
            for i, value in enumerate((VERSION, num_readers, num_slots, slot_bytes, stride)):
                header[1 + i] = value
            _fence()
            header[0] = MAGIC  # last: a complete header is marked valid
            header.release()
            return cls(shm, None, overflow_address)
        except BaseException:
            shm.close()
            unlink_segment(name)
            raise

    @classmethod
    def attach(cls, name: str, reader_rank: int,
               overflow_address: str | None = None) -> BroadcastRing:
        """Reader side: attach to an existing ring as reader `reader_rank`.
        FileNotFoundError before the writer created it, RingNotReady while the
        writer is still filling it in: both are worth a retry."""
        check_segment_name(name)
        try:
            shm = attach_segment(name)
        except ValueError as e:  # the name is valid: mmap refused a 0-byte segment
            raise RingNotReady(f"segment {name!r} is not sized yet") from e
        try:
            return cls(shm, reader_rank, overflow_address)
        except BaseException:
            shm.close()
            raise

    def put(self, data: bytes, timeout: float) -> None:
        """Publish `data` to every reader; TimeoutError if the ring stays full."""
        self._check_role(is_writer=True)
        deadline = time.monotonic() + timeout
        seq = self._next_seq
        index = (seq - 1) % self.num_slots
        header = self._headers[index]
        readers = slice(_READ_SEQ0, _READ_SEQ0 + self.num_readers)
        _spin_until(lambda: min(header[readers]) >= header[_SEQ], deadline,
                    f"put: ring {self.name!r} full (a reader is behind)")
        _fence()
        num_bytes = len(data)
        if num_bytes <= self.slot_bytes:
            self._payloads[index][:num_bytes] = data
            header[_LENGTH] = num_bytes
        else:
            header[_OVERFLOW_ID] = self._send_overflow(data, deadline)
            header[_LENGTH] = OVERFLOW
            self._last_overflow_seq = seq
        # ORDER: payload and length (or the overflow frame and id) are written
        # above; the seq ("written" flag) is published last, after a fence, so a
        # reader that sees seq == k finds message k complete.
        _fence()
        header[_SEQ] = seq
        self._next_seq = seq + 1

    def get(self, timeout: float) -> bytes:
        """The next message, in order; TimeoutError if none arrives in time."""
        self._check_role(is_writer=False)
        deadline = time.monotonic() + timeout
        seq = self._next_seq
        index = (seq - 1) % self.num_slots
        header = self._headers[index]
        _spin_until(lambda: header[_SEQ] == seq, deadline,
                    f"get: no message in ring {self.name!r}")
        # ORDER: the seq was read first (above), then the payload, and only
        # after that is our read flag set, which frees the slot for the writer.
        _fence()
        num_bytes = header[_LENGTH]
        if num_bytes == OVERFLOW:
            data = self._recv_overflow(header[_OVERFLOW_ID], deadline)
        else:
            data = bytes(self._payloads[index][:num_bytes])
        _fence()
        header[_READ_SEQ0 + self.reader_rank] = seq
        self._next_seq = seq + 1
        return data

    def close(self, drain_timeout: float = 1.0) -> None:
        """Release this process's mapping and sockets (idempotent).

        The writer first waits up to `drain_timeout` s until every reader has
        taken the last overflow message, which linger 0 would otherwise drop.
        """
        if self._is_closed:
            return
        self._is_closed = True
        if self.is_writer and self._last_overflow_seq:
            self._wait_drained(self._last_overflow_seq, drain_timeout)
        if self._overflow is not None:
            self._overflow.close()
        for view in self._headers + self._payloads:
            view.release()
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment's name (writer only; idempotent)."""
        self._check_role(is_writer=True, may_be_closed=True)
        unlink_segment(self.name)

    def __enter__(self) -> BroadcastRing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close; the writer also unlinks."""
        self.close()
        if self.is_writer:
            self.unlink()

    def _send_overflow(self, data: bytes, deadline: float) -> int:
        if self._overflow is None:
            raise ValueError(f"message of {len(data)} bytes exceeds slot_bytes="
                             f"{self.slot_bytes} and ring {self.name!r} has no overflow_address")
        return self._overflow.send(data, deadline)

    def _recv_overflow(self, overflow_id: int, deadline: float) -> bytes:
        if self._overflow is None:
            raise RuntimeError(f"ring {self.name!r} sent an overflow message but this "
                               "reader attached without overflow_address")
        return self._overflow.recv(overflow_id, deadline)

    def _wait_drained(self, seq: int, timeout: float) -> None:
        header = self._headers[(seq - 1) % self.num_slots]
        readers = slice(_READ_SEQ0, _READ_SEQ0 + self.num_readers)
        try:
            _spin_until(lambda: min(header[readers]) >= seq, time.monotonic() + timeout,
                        "close: readers did not drain")
        except TimeoutError:
            pass  # a reader is gone or stuck; closing anyway

    def _check_role(self, is_writer: bool, may_be_closed: bool = False) -> None:
        if self.is_writer != is_writer:
            raise RuntimeError(f"only a {'writer' if is_writer else 'reader'} may do this")
        if self._is_closed and not may_be_closed:
            raise RuntimeError(f"ring {self.name!r} is closed")


def _spin_until(is_ready: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll `is_ready`: busy, then yielding, then sleeping up to 1 ms at a time."""
    num_polls = 0
    sleep_s = 1e-5
    while not is_ready():
        if time.monotonic() >= deadline:
            raise TimeoutError(what)
        num_polls += 1
        if num_polls < _NUM_BUSY_POLLS:
            continue
        if num_polls < _NUM_BUSY_POLLS + _NUM_YIELDS:
            time.sleep(0)
            continue
        time.sleep(min(sleep_s, max(0.0, deadline - time.monotonic())))
        sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)


def _fence() -> None:
    """Best-effort full memory barrier: an uncontended lock does atomic ops."""
    with _FENCE_LOCK:
        pass


def _slot_header_bytes(num_readers: int) -> int:
    return _round_up(8 * (_READ_SEQ0 + num_readers), ALIGN)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
