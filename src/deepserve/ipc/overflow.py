"""OverflowChannel: the ZeroMQ side channel of a BroadcastRing.

A message too long for a ring slot travels as a ZeroMQ frame instead. The
writer binds one PUSH socket per reader at `{address}-r{rank}`; each reader
connects one PULL socket when it attaches. A PUSH socket queues nothing while
its reader is not yet connected, so `send` waits (until its deadline) instead
of losing the frame: there is no slow-joiner problem as with PUB/SUB, and
PUSH never drops at the high-water mark either.

Each frame is `[overflow_id (8 bytes, little-endian), payload]`. The writer
numbers frames itself and never reuses a number, so a reader can drop a frame
left behind by a send that timed out half-way through the readers.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import zmq


class OverflowChannel:
    """Writer: `send` to every reader. Reader: `recv` the frame a slot names."""

    def __init__(self, address: str, ranks: list[int], is_writer: bool):
        if not address.startswith("ipc://"):
            raise ValueError(f"overflow_address must start with ipc://, got {address!r}")
        self.is_writer = is_writer
        self._next_overflow_id = 1
        self._sockets: list[zmq.Socket] = []
        self._bound_paths: list[str] = []  # socket files this writer made
        ctx = zmq.Context.instance()
        try:
            for path in [f"{address[len('ipc://'):]}-r{rank}" for rank in ranks]:
                sock = ctx.socket(zmq.PUSH if is_writer else zmq.PULL)
                sock.setsockopt(zmq.LINGER, 0)
                self._sockets.append(sock)
                if is_writer:
                    sock.bind(f"ipc://{path}")
                    self._bound_paths.append(path)
                else:
                    sock.connect(f"ipc://{path}")
        except BaseException:
            self.close()
            raise

    def send(self, data: bytes, deadline: float) -> int:
        """Queue `data` for every reader (zero-copy); returns its overflow id.

        `data` must not change afterwards: ZeroMQ reads it while sending.
        """
        overflow_id = self._next_overflow_id
        self._next_overflow_id += 1  # used up even if a reader times out below
        parts = [overflow_id.to_bytes(8, "little"), zmq.Frame(data)]
        for rank, sock in enumerate(self._sockets):
            while True:
                try:
                    sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if not sock.poll(remaining_ms(deadline), zmq.POLLOUT):
                        raise TimeoutError(f"overflow reader {rank} is not connected "
                                           "or not reading") from None
        return overflow_id

    def recv(self, overflow_id: int, deadline: float) -> bytes:
        """The frame numbered `overflow_id`; older leftovers are dropped."""
        sock = self._sockets[0]
        while True:
            if not sock.poll(remaining_ms(deadline), zmq.POLLIN):
                raise TimeoutError(f"overflow frame {overflow_id} did not arrive")
            id_bytes, data = sock.recv_multipart(flags=zmq.NOBLOCK)
            frame_id = int.from_bytes(id_bytes, "little")
            if frame_id == overflow_id:
                return data
            if frame_id > overflow_id:
                raise RuntimeError(f"overflow frame {frame_id} arrived before {overflow_id}")

    def close(self) -> None:
        """Close the sockets with linger 0 (unsent frames are dropped).

        The writer also removes its socket files: libzmq removes them only
        when its I/O thread gets round to it, which may be after exit.
        """
        for sock in self._sockets:
            sock.close(linger=0)
        for path in self._bound_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._sockets, self._bound_paths = [], []


def remaining_ms(deadline: float) -> int:
    """Milliseconds until `deadline` (time.monotonic), rounded up, at least 0."""
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))
