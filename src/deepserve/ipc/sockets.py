"""Typed ZeroMQ sockets: msgspec msgpack on the wire, one decoder per channel.

A channel's message type is usually a tagged union of msgspec Structs (see
`deepserve.messages`), so one `msgspec.msgpack.Decoder(type)` decodes every
message the channel carries. Every socket sets linger 0, every receive takes
a timeout, and `.socket` is exposed for `zmq.Poller`.

A frame that does not decode as the channel's type (garbage bytes, msgpack
of the wrong shape, an unknown tag, a field of the wrong type: anything a
local process could write to the socket) is counted, logged at most once per
DROP_LOG_INTERVAL_S, and dropped: `get` and `drain` never raise on it, so no
actor's loop dies of one bad frame.

A receiving socket may also be given `admit(member, msg) -> reason`: on a
CURVE socket each message comes with the member that sent it (its node's
name and role, curve.peer), and a message about what is not that member's
own (another node's TE, a head's order from a plain node) is ignored:
counted (`num_ignored`), logged and reported (`peer_ignored`) as an undecodable
frame is. Messages no CURVE handshake vouched for (ipc://, not secure) are
not asked about: one host's file system guards those.

Every receiving socket caps its frames (ZMQ_MAXMSGSIZE, `max_bytes`,
MAX_FRAME_BYTES unless its channel says otherwise): a peer that sends a
bigger one is disconnected by ZeroMQ before the frame is held in memory, so
one multi-GB frame to a tcp inbox no longer takes its process's memory.
"""

from __future__ import annotations

import logging
import math
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import zmq

from deepserve.ipc import curve

log = logging.getLogger(__name__)
MAX_IPC_PATH_LEN = 100  # sun_path holds 107 bytes on Linux (103 on macOS)
DROP_LOG_INTERVAL_S = 10.0
"""Seconds between two log lines about undecodable frames of one socket."""
MAX_FRAME_BYTES = 64 << 20
"""A receiving socket's frame cap unless its channel sets one: 8x the largest
request body the gateway takes (max_body_bytes, 8 MiB) and its ids, and over
a TE report of a large pool's hashes; far below what takes a host's memory."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now (for a listener started just after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ipc_address(run_dir: str | Path, name: str) -> str:
    """`ipc://{run_dir}/{name}.sock`; ValueError if the path is too long."""
    path = f"{run_dir}/{name}.sock"
    if len(path.encode()) >= MAX_IPC_PATH_LEN:
        raise ValueError(f"ipc socket path {path!r} has {len(path.encode())} bytes; "
                         f"it must be shorter than {MAX_IPC_PATH_LEN} (use a shorter run_dir)")
    return f"ipc://{path}"


LOCAL = "local"
"""A bind address: this host's processes only, over ipc:// in a directory of its
own (bind_local). What a one-host listener takes instead of loopback TCP, which
every local user (and a browser's fetch) can reach and CURVE does not cover."""


def bind_local(sock: zmq.Socket, prefix: str) -> tuple[str, Path]:
    """Bind `sock` to an ipc:// path in a new directory under $TMPDIR that only
    this user may enter (0700): (the address, the directory, which the caller
    removes once the socket is closed)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        address = ipc_address(directory, "s")
        sock.bind(address)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return address, directory


def bind_listener(sock: zmq.Socket, bind: str, prefix: str) -> tuple[str, Path | None]:
    """Bind `sock` to `bind`: LOCAL (bind_local, its directory named `prefix`...),
    or an address (CURVE first where it is tcp:// and the process is secure).
    (The bound address, LOCAL's directory or None.)"""
    if bind == LOCAL:
        return bind_local(sock, prefix)
    curve.secure(sock, bind, bind=True)
    sock.bind(bind)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode(), None


def endpoints(addr: str) -> list[str]:
    """The endpoints of an address: one, or several joined by commas (a cluster
    with standby heads: the same socket on each head host, this host's first)."""
    return [a.strip() for a in addr.split(",") if a.strip()]


HEARTBEAT_MS = 1000
"""ZMTP heartbeats on tcp:// sockets: a PING this often, and a peer silent for
HEARTBEAT_TIMEOUT_MS is dropped. A peer cut off without a reset (a partition,
a host powered off) otherwise keeps its pipe for the kernel's retransmission
timeout (minutes): a PUSH to several heads would go on queueing to it."""
HEARTBEAT_TIMEOUT_MS = 3000


def bind_or_connect(sock: zmq.Socket, addr: str, bind: bool) -> None:
    """Bind addr's first endpoint (this host's), or connect to every one. With
    several, a sending socket gets ZMQ_IMMEDIATE: it queues only to a peer that
    is there (the live head), never to an endpoint nobody binds yet. tcp://
    sockets get ZMTP heartbeats (HEARTBEAT_MS)."""
    first, *others = endpoints(addr) or [addr]
    if first.startswith("tcp://"):
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    if bind:
        sock.bind(first)
        return
    if others:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    for endpoint in (first, *others):
        sock.connect(endpoint)


def _open(ctx: zmq.Context, kind: int, addr: str, bind: bool,
          before: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
    """A socket bound or connected to addr (bind_or_connect); `before(sock)`
    runs just before that."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        curve.secure(sock, addr, bind)
        if before is not None:
            before(sock)
        bind_or_connect(sock, addr, bind)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _to_ms(timeout: float) -> int:
    return max(0, math.ceil(timeout * 1000))


class _Sender:
    def __init__(self, ctx: zmq.Context, kind: int, addr: str, bind: bool):
        self.socket = _open(ctx, kind, addr, bind)
        self._encoder = msgspec.msgpack.Encoder()
        self.to_heads = not bind and len(endpoints(addr)) > 1
        """Connected to every head's socket (standby heads): at most one is there."""
        self.num_unsent = 0
        """Messages put without a timeout that no head was there to take (to_heads)."""

    def put(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj`; with a timeout, TimeoutError if it cannot be queued in time.
        Without one it waits for a peer, but for a socket to every head's
        (to_heads): while no head is there (a standby taking over) the message is
        dropped and counted, as what goes to a cluster manager is sent again
        (TEUp, TEReport): a TE's loop never stalls on a failover."""
        data = self._encoder.encode(obj)
        if timeout is None and self.to_heads:
            try:
                self.socket.send(data, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.num_unsent += 1
            return
        if timeout is None:
            self.socket.send(data, copy=False)
            return
        try:
            if self.socket.poll(_to_ms(timeout), zmq.POLLOUT):
                self.socket.send(data, flags=zmq.NOBLOCK, copy=False)
                return
        except zmq.Again:
            pass
        raise TimeoutError(f"put: no peer ready on {self.socket.last_endpoint!r}")

    def close(self) -> None:
        self.socket.close(linger=0)


AGAIN = object()
"""What _Receiver._recv returns when a readable socket held no message."""

Admit = Callable[[tuple[str, str], Any], str]
"""(member name, role), message -> "" to take it, else why it is ignored."""


class _Receiver:
    def __init__(self, ctx: zmq.Context, kind: int, addr: str, bind: bool, type: Any,
                 watch_handshakes: bool = False, max_bytes: int = MAX_FRAME_BYTES,
                 admit: Admit | None = None):
        self.handshakes: curve.HandshakeWatch | None = None
        """With watch_handshakes, the socket's failed handshakes from its very first
        (curve.HandshakeWatch, attached before it connects)."""

        def before(sock: zmq.Socket) -> None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # before any peer: it holds for all
            if watch_handshakes:
                self.handshakes = curve.HandshakeWatch(sock)
        self.socket = _open(ctx, kind, addr, bind, before)
        self._decoder = msgspec.msgpack.Decoder(type)
        self.num_dropped = 0
        """Frames dropped because they did not decode (see the module docstring)."""
        self._num_unlogged = 0
        self._logged_at: float | None = None
        self._admit = admit if curve.active() is not None else None  # else: no members
        self.ignored = curve.Ignored() if self._admit is not None else None
        """Messages a member sent about what is not its own (admit said why)."""

    @property
    def num_ignored(self) -> int:
        return self.ignored.count if self.ignored is not None else 0

    def _recv(self) -> Any:
        """The next waiting message; None if it does not decode or is not
        admitted; AGAIN if there was none after all (a poll may report a
        tcp:// socket readable for a ZMTP heartbeat, which is no message)."""
        try:
            frame = self.socket.recv(flags=zmq.NOBLOCK, copy=self._admit is None)
        except zmq.Again:
            return AGAIN
        if self._admit is None:
            return self.decode(frame)
        msg = self.decode(frame.bytes)
        member = curve.peer(frame) if msg is not None else None
        if member is not None:
            reason = self._admit(member, msg)
            if reason:
                self.ignored.note(self.socket, member, type(msg).__name__, reason)
                return None
        return msg

    def decode(self, data: bytes) -> Any | None:
        """The message `data` encodes, or None (counted, logged, dropped)."""
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            self._note_dropped(data, exc)
            return None

    def _note_dropped(self, data: bytes, exc: Exception) -> None:
        self.num_dropped += 1
        self._num_unlogged += 1
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= DROP_LOG_INTERVAL_S:
            log.warning("%s: dropped %d undecodable frame(s); last %d bytes: %s",
                        self.socket.last_endpoint.decode(errors="replace") or "socket",
                        self._num_unlogged, len(data), exc)
            self._logged_at, self._num_unlogged = now, 0

    def poll(self, timeout: float | None) -> bool:
        """True if a message is ready within `timeout` s (None: wait forever)."""
        timeout_ms = None if timeout is None else _to_ms(timeout)
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def get(self, timeout: float | None) -> Any:
        """The next message that decodes; TimeoutError after `timeout` s (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.poll(left):
                raise TimeoutError(f"get: nothing received within {timeout} s")
            msg = self._recv()
            if msg is not None and msg is not AGAIN:
                return msg

    def drain(self) -> list[Any]:
        """Every message already waiting that decodes, without blocking."""
        out = []
        while self.socket.poll(0, zmq.POLLIN):
            msg = self._recv()
            if msg is AGAIN:
                break
            if msg is not None:
                out.append(msg)
        return out

    def close(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
        if self.ignored is not None:
            self.ignored.close()
        self.socket.close(linger=0)


class PushSocket(_Sender):
    """PUSH end of a stream; `put` blocks while no PULL peer is connected."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool):
        super().__init__(ctx, zmq.PUSH, addr, bind)


class PullSocket(_Receiver):
    """PULL end of a stream, decoding every message as `type`."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool, type: Any,
                 max_bytes: int = MAX_FRAME_BYTES, admit: Admit | None = None):
        super().__init__(ctx, zmq.PULL, addr, bind, type, max_bytes=max_bytes, admit=admit)


class PubSocket(_Sender):
    """PUB end of a broadcast; drops messages nobody has subscribed to yet."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = True):
        super().__init__(ctx, zmq.PUB, addr, bind)


class SubSocket(_Receiver):
    """SUB end of a broadcast, subscribed to everything, decoding as `type`."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool, type: Any,
                 watch_handshakes: bool = False, max_bytes: int = MAX_FRAME_BYTES):
        super().__init__(ctx, zmq.SUB, addr, bind, type, watch_handshakes, max_bytes)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
