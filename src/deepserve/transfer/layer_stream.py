"""LayerStream: whole blocks held in one process, pulled a layer at a time by another.

DualPath's decode-engine read path across hosts: the decode TE reads a
prompt's disk hits through its own storage bucket into host memory (Full
Blocks), and the prefill TE pulls them as Layer Blocks, layer i just before
its forward computes layer i (worker/layer_loads.py):

    decode TE's worker                              prefill TE's worker
    LayerStreamServer.put(stream_id, blocks)        LayerStreamClient(address)
      blocks (n, 2, L, H, bs, D), whole             .pull(stream_id, layer, rows)
      ROUTER (the host's address) <-- Pull(req, stream_id, layer, rows) -- DEALER
                                  --- Layer(req, ok) [+ one data frame] -->
    .drop(stream_id) when the prefill TE is done;   (n_rows, 2, H, bs, D)
    a stream nobody pulls for ttl_s goes by itself

The server holds at most `max_bytes` of blocks (put refuses past it: the
caller streams fewer). Every wait is bounded: a pull that gets no answer in
timeout_s, or an answer with ok False (unknown stream, a row or layer out of
range), raises TransferError; a late answer to an earlier pull is dropped by
its request id. Both ends are CURVE-secured across hosts like every tcp socket.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from deepserve.ipc import curve
from deepserve.ipc.sockets import bind_listener
from deepserve.transfer.receiver import WILDCARDS
from deepserve.transfer.types import TransferError

log = logging.getLogger(__name__)
POLL_MS = 50  # how often the server looks at its stop flag and expiries
DEFAULT_TTL_S = 120.0  # a stream nobody pulled for this long is dropped
DEFAULT_MAX_BYTES = 256 << 20


class Pull(msgspec.Struct, tag=True, array_like=True):
    req: int
    stream_id: int
    layer: int
    rows: list[int]  # blocks of the stream, in the order wanted


class Layer(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    req: int
    ok: bool
    shape: tuple[int, ...] = ()  # of the data frame: (len(rows), 2, H, bs, D)
    dtype: str = ""
    error: str = ""


_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16,
                                                     torch.float16)}


@dataclass
class _Stream:
    blocks: torch.Tensor  # (n, 2, L, H, bs, D)
    expires: float


class LayerStreamServer:
    """Named buffers of whole blocks, served one layer at a time on a thread of its own."""

    def __init__(self, bind: str, ctx: zmq.Context, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl_s: float = DEFAULT_TTL_S):
        """bind: LOCAL (ipc://, this host's processes only), or "tcp://HOST:0" with
        this host's address for pulls from other hosts."""
        if bind.startswith(WILDCARDS):
            raise ValueError(f"bind {bind!r}: name this host's address, not a wildcard")
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address, self._dir = bind_listener(self._sock, bind, "ds-ls-")  # _dir: LOCAL's
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams
        self.num_pulls = 0  # layers served
        self.bytes_served = 0
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Pull)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="layer-stream", daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(_nbytes(s.blocks) for s in self._streams.values())

    def room(self, block_bytes: int) -> int:
        """How many more blocks of block_bytes fit under max_bytes."""
        return max(0, self.max_bytes - self.held_bytes) // block_bytes

    def put(self, stream_id: int, blocks: torch.Tensor) -> None:
        """Serve blocks (n, 2, L, H, bs, D) as stream_id (replacing one of that id)."""
        if blocks.dim() != 6:
            raise ValueError(f"blocks must be (n, 2, L, H, bs, D), got {tuple(blocks.shape)}")
        with self._lock:
            old = self._streams.pop(stream_id, None)
            held = sum(_nbytes(s.blocks) for s in self._streams.values())
            if held + _nbytes(blocks) > self.max_bytes:
                if old is not None:
                    self._streams[stream_id] = old
                raise ValueError(f"stream {stream_id}: {_nbytes(blocks)} bytes over the "
                                 f"buffer's {self.max_bytes - held} free")
            self._streams[stream_id] = _Stream(blocks, time.monotonic() + self.ttl_s)

    def drop(self, stream_id: int) -> bool:
        with self._lock:
            return self._streams.pop(stream_id, None) is not None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            self._streams.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._expire()
                if self._sock.poll(POLL_MS, zmq.POLLIN):
                    self._serve(self._sock.recv_multipart())
        except zmq.ZMQError as e:  # the context went away under us
            log.warning("layer stream server stops: %s", e)
        finally:
            self._sock.close(linger=0)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for sid in [k for k, s in self._streams.items() if now > s.expires]:
                log.warning("stream %d not pulled for %g s: dropped", sid, self.ttl_s)
                del self._streams[sid]

    def _serve(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            if len(frames) != 2:
                raise msgspec.ValidationError(f"{len(frames) - 1} frames, not 1")
            pull = self._dec.decode(frames[1])
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            log.warning("layer stream: bad request dropped: %s", e)
            return
        try:
            data = self.layer(pull.stream_id, pull.layer, pull.rows)
        except (KeyError, IndexError, ValueError) as e:
            reply = Layer(pull.req, False, error=str(e))
            self._sock.send_multipart([ident, self._enc.encode(reply)])
            return
        reply = Layer(pull.req, True, tuple(data.shape), str(data.dtype).removeprefix("torch."))
        self.num_pulls += 1  # before the reply: a puller that has it sees it counted
        self.bytes_served += _nbytes(data)
        self._sock.send_multipart([ident, self._enc.encode(reply),
                                   data.view(-1).view(torch.uint8).numpy()])

    def layer(self, stream_id: int, layer: int, rows: list[int]) -> torch.Tensor:
        """What a Pull gets: (len(rows), 2, H, bs, D), a copy. A worker reading
        a stream of its own (a prefill TE's PE buffer) calls it directly;
        KeyError (no such stream), IndexError (a layer or row out of range)."""
        with self._lock:
            stream = self._streams.get(stream_id)
            if stream is None:
                raise KeyError(f"no stream {stream_id} here (dropped, expired or never put)")
            stream.expires = time.monotonic() + self.ttl_s
            blocks = stream.blocks
        n, _, num_layers = blocks.shape[:3]
        if not 0 <= layer < num_layers:
            raise IndexError(f"layer {layer} out of range [0, {num_layers})")
        if len(rows) > n or any(not 0 <= r < n for r in rows):
            raise IndexError(f"rows: at most {n}, each in [0, {n})")
        index = torch.tensor(rows, dtype=torch.long)
        return blocks[:, :, layer].index_select(0, index).contiguous()


class LayerStreamClient:
    """One DEALER to a LayerStreamServer; pulls one at a time (not thread-safe)."""

    def __init__(self, address: str, ctx: zmq.Context, timeout_s: float):
        self.address, self.timeout_s = address, timeout_s
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._reqs = itertools.count(1)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Layer)
        try:
            curve.secure(self._sock, address, bind=False)
            self._sock.connect(address)
        except BaseException:
            self._sock.close(linger=0)
            raise

    def pull(self, stream_id: int, layer: int, rows: list[int]) -> torch.Tensor:
        """Layer `layer` of the stream's blocks `rows`: (len(rows), 2, H, bs, D)."""
        req = next(self._reqs)
        deadline = time.monotonic() + self.timeout_s
        if not self._sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
            raise TransferError(f"layer stream {self.address} unreachable in {self.timeout_s} s")
        self._sock.send(self._enc.encode(Pull(req, stream_id, layer, rows)), zmq.NOBLOCK)
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
            reply = self._dec.decode(frames[0])
            if reply.req != req:
                continue  # the answer to a pull that timed out
            if not reply.ok:
                raise TransferError(f"layer stream {self.address}: {reply.error}")
            return _tensor(reply, frames)
        raise TransferError(f"no layer {layer} of stream {stream_id} from {self.address} "
                            f"in {self.timeout_s} s")

    def close(self) -> None:
        self._sock.close(linger=0)


def _tensor(reply: Layer, frames: list[bytes]) -> torch.Tensor:
    dtype = _DTYPES.get(reply.dtype)
    if dtype is None or len(frames) != 2:
        raise TransferError(f"layer stream: a reply of dtype {reply.dtype!r} in "
                            f"{len(frames)} frames")
    data = bytearray(frames[1])
    expect = torch.Size(reply.shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(data) != expect:
        raise TransferError(f"layer stream: short layer, {len(data)} of {expect} bytes")
    return torch.frombuffer(data, dtype=dtype).view(reply.shape) if data else \
        torch.empty(reply.shape, dtype=dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

