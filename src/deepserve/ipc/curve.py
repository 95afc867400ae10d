"""CURVE on every ZeroMQ socket that crosses hosts ([cluster] secure = true).

    bin/deepserve-keys DIR [--node NAME]   the key files (ipc/curve_keys.py): the cluster's
                              server pair, each node's own pair, the allow-list DIR/allowed
    a secure process          $DEEPSERVE_CURVE_KEYS = DIR, $DEEPSERVE_CURVE_NODE = its node's
                              [cluster] name (the node sets them; children inherit)
      tcp:// bound            CURVE server with the cluster's pair, ZAP domain "deepserve",
                              ZAP enforced (no handler: no peer gets in)
      tcp:// connected        CURVE client with its node's own pair, the server key the
                              cluster's public key
      ipc://, inproc://       as they were (one host: the file system guards them)

Every ZeroMQ context that binds a secure socket gets one Guard thread:
    ZAP handler   a CURVE client whose key is not on the allow-list -> refused (400);
                  one on it is admitted as its node: user id NAME, property Role
                  ("head" or ""), which `peer(frame)` reads off each message it sends
    monitor       a handshake that fails before ZAP (no CURVE at all, a wrong server
                  key: the peer does not hold the cluster key) -> already refused
    each refusal  -> log warning + `peer_refused` health event (component, endpoint,
                  peer where ZAP names it, reason), at most one per endpoint and reason
                  every REPORT_EVERY_S, the next one carrying how many were folded in.
The guard leaves when its context terminates (every poll gets ETERM), closing its
sockets, so `ctx.term()` never waits on it. A secure socket is configured by
`secure(sock, address, bind)` before its bind or connect; every place that opens
a tcp:// socket calls it (ipc/sockets.py, the gateway's links, DistFlow).

DistFlow's handshake (Hello/Welcome) runs over such a socket: a sender without
the key never reaches it, so it can neither pull nor push KV.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from pathlib import Path

import zmq
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from deepserve.ipc.curve_keys import HEAD, AllowList, Keys
from deepserve.ipc.heartbeat import HeartbeatSender

log = logging.getLogger(__name__)
ENV_VAR = "DEEPSERVE_CURVE_KEYS"
NODE_ENV_VAR = "DEEPSERVE_CURVE_NODE"
DOMAIN = b"deepserve"
ZAP_ADDRESS = "inproc://zeromq.zap.01"
REPORT_EVERY_S = 10.0
"""At most one peer_refused per (endpoint, reason) this often; the rest are counted."""
POLL_MS = 200
"""How often the guard looks for sockets newly put in its watch."""
_MONITORED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_MONITOR_STOPPED)
"""A handshake refused by ZAP is reported by the ZAP handler (it names the peer). A peer
without CURVE that reads our greeting first hangs up before we read its own: we see
that as a handshake broken off (no detail), so that counts as a refusal too."""
_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "no CURVE (the peer has no cluster key)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "CURVE handshake failed (another cluster's key)",
}

BROKEN_OFF = "handshake broken off by the peer (no cluster key?)"
NOT_ALLOWED = "CURVE key not on the allow-list (not a member, or revoked)"


def _metadata(properties: dict[str, str]) -> bytes:
    """ZAP's metadata frame (ZMTP property encoding): what a received frame's
    get(name) answers on the server's side."""
    out = b""
    for name, value in properties.items():
        out += bytes([len(name)]) + name.encode() + struct.pack(">I", len(value)) + value.encode()
    return out


# -- the process's policy ---------------------------------------------------------------
_loaded: dict[tuple[str, str], Keys] = {}
_component = f"pid{os.getpid()}"


def enable(directory: str | Path, node: str) -> Keys:
    """Make this process and every child it starts from now on secure, as node
    `node`: checks the keys (curve_keys.KeysError) and sets $DEEPSERVE_CURVE_KEYS
    and $DEEPSERVE_CURVE_NODE."""
    keys = Keys.load(directory, node)
    os.environ[ENV_VAR] = str(Path(directory).resolve())
    os.environ[NODE_ENV_VAR] = node
    return keys


def active() -> Keys | None:
    """The keys this process secures tcp:// sockets with, or None (not secure)."""
    directory = os.environ.get(ENV_VAR)
    if not directory:
        return None
    node = os.environ.get(NODE_ENV_VAR, "")
    keys = _loaded.get((directory, node))
    if keys is None:
        keys = _loaded[(directory, node)] = Keys.load(directory, node)
    return keys


def peer(frame: zmq.Frame) -> tuple[str, str] | None:
    """(node name, role) of the member that sent `frame` (received with
    copy=False on a secure tcp:// socket: what the guard's ZAP answer named),
    or None where no CURVE handshake vouched for it (ipc://, not secure)."""
    try:
        name = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    try:
        role = frame.get("Role")
    except zmq.ZMQError:
        role = ""
    return name, role


def own_or_head(member: tuple[str, str]) -> bool:
    """The member is this process's own node, or a head (or standby head)."""
    keys = active()
    return member[1] == HEAD or (keys is not None and member[0] == keys.node)


def from_head(member: tuple[str, str], msg) -> str:
    """`admit` (ipc/sockets.py) of a socket that takes orders only from a head:
    ScaleOut / ScaleIn, requests to a TE, to the job executor."""
    return "" if own_or_head(member) else "only a head's key may send it"


def set_component(component: str) -> None:
    """The health-log component this process's refusals are reported as."""
    global _component
    _component = component


def secure(sock: zmq.Socket, address: str, bind: bool) -> None:
    """Configure `sock` for `address` before its bind or connect: CURVE when the
    address is tcp:// and this process is secure; nothing otherwise."""
    if not address.startswith("tcp://"):
        return
    keys = active()
    if keys is None:
        return
    if not bind:  # our node's own pair; the server must hold the cluster's
        sock.curve_secretkey = keys.node_secret
        sock.curve_publickey = keys.node_public
        sock.curve_serverkey = keys.public
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    Guard.of(sock.context, keys).watch(sock)


class HandshakeWatch:
    """A connecting socket's failed handshakes, read by its owner (no thread): how a
    node joining a cluster learns that the head refuses it, and why, instead of
    waiting out its startup timeout. Secure or not, any tcp:// socket."""

    _EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
               | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    BROKEN_OFF_AFTER = 3
    """Handshakes broken off (no detail: a reset may be one) that make a refusal."""

    def __init__(self, sock: zmq.Socket):
        """Attach it before `sock` connects (ipc/sockets.py: watch_handshakes): libzmq
        may not retry a refused handshake soon, so the first one must be seen."""
        self._sock = sock
        self._pair = sock.get_monitor_socket(self._EVENTS)
        self.num_failed = 0
        self.reason = ""
        self.definite = False  # the peer said why (ZAP) or the mechanisms disagree

    def poll(self) -> bool:
        """Read what happened since the last call: refused yet? (a definite failure,
        or BROKEN_OFF_AFTER handshakes broken off)"""
        while self._pair.poll(0):
            event = recv_monitor_message(self._pair)
            self.num_failed += 1
            reason = {zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                      "one side runs [cluster] secure = true, the other does not",
                      zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                      "CURVE failed: another cluster's key"}.get(event["value"])
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = ("it refused our key: not on its allow-list (bin/deepserve-keys "
                          "DIR --node NAME puts it there; or this node was revoked)")
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and reason:
                self.reason, self.definite = reason, True
            elif not self.definite:
                self.reason = "it broke the handshake off: its [cluster] secure or keys differ"
        return self.definite or self.num_failed >= self.BROKEN_OFF_AFTER

    def close(self) -> None:
        self._sock.disable_monitor()
        self._pair.close(linger=0)


# -- the guard ----------------------------------------------------------------------------
_guards: dict[int, Guard] = {}
_guards_lock = threading.Lock()


class Guard:
    """One per ZeroMQ context with a secure bound socket: answers ZAP and reads
    the monitors of that context's bound sockets (see the module doc)."""

    @classmethod
    def of(cls, ctx: zmq.Context, keys: Keys) -> Guard:
        with _guards_lock:
            guard = _guards.get(ctx.underlying)
            if guard is None:
                guard = _guards[ctx.underlying] = cls(ctx, keys)
            return guard

    def __init__(self, ctx: zmq.Context, keys: Keys):
        self.keys = keys
        self.allowed = AllowList(keys.directory)
        self._ctx = zmq.Context.shadow(ctx.underlying)
        self._key = ctx.underlying
        self._zap = self._ctx.socket(zmq.REP)  # bound before any secure socket of ctx
        self._zap.linger = 0
        self._zap.bind(ZAP_ADDRESS)
        self._new: queue.SimpleQueue = queue.SimpleQueue()  # monitor PAIRs for the thread
        self._events = _FoldedEvents("peer_refused", "peer refused")  # the guard thread's
        self.num_refused = 0
        self._thread = threading.Thread(target=self._run, name="curve-guard", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        """Read `sock`'s handshake failures (call before its bind: none is missed)."""
        address = f"inproc://curve-monitor-{id(sock)}-{time.monotonic_ns()}"
        sock.monitor(address, _MONITORED)
        pair = self._ctx.socket(zmq.PAIR)
        pair.linger = 0
        pair.connect(address)
        self._new.put(pair)  # a socket may move to another thread behind a full fence

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while True:
                while not self._new.empty():
                    pair = self._new.get()
                    monitors.append(pair)
                    poller.register(pair, zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS):
                    if sock is self._zap:
                        self._answer(self._zap.recv_multipart())
                    elif not self._monitor_event(sock):
                        poller.unregister(sock)
                        monitors.remove(sock)
                        sock.close(linger=0)
        except zmq.ZMQError:  # ETERM (the context is terminating) or its sockets closed
            pass
        finally:
            with _guards_lock:
                if _guards.get(self._key) is self:
                    del _guards[self._key]
            while not self._new.empty():
                monitors.append(self._new.get())
            for sock in [self._zap, *monitors]:
                sock.close(linger=0)
            self._events.close()

    def _answer(self, frames: list[bytes]) -> None:
        """ZAP (RFC 27): version, request id, domain, address, identity, mechanism,
        credentials -> version, request id, status, text, user id, metadata."""
        if len(frames) < 6:  # not from libzmq; a REP answers every request all the same
            self._zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400",
                                      b"bad ZAP request", b"", b""])
            return
        version, request_id, _, address, _, mechanism = frames[:6]
        member = None
        if mechanism == b"CURVE" and len(frames) > 6:
            member = self.allowed.member(zmq.utils.z85.encode(frames[6]))
        if member is None:
            self._zap.send_multipart([version, request_id, b"400", b"not on the allow-list",
                                      b"", b""])
            self._refused("", address.decode(errors="replace"),
                          NOT_ALLOWED if mechanism == b"CURVE"
                          else f"mechanism {mechanism.decode(errors='replace')}")
            return
        name, role = member
        self._zap.send_multipart([version, request_id, b"200", b"OK", name.encode(),
                                  _metadata({"Role": role})])

    def _monitor_event(self, pair: zmq.Socket) -> bool:
        """Report one monitor event; False once the monitored socket closed."""
        event = recv_monitor_message(pair)
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return False
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            reason = BROKEN_OFF
        else:
            reason = _PROTOCOL_REASONS.get(event["value"], "handshake failed")
        self._refused(event["endpoint"].decode(errors="replace"), "", reason)
        return True

    def _refused(self, endpoint: str, peer: str, reason: str) -> None:
        self.num_refused += 1
        self._events.report(self._ctx, (endpoint or peer, reason),  # ZAP names the peer,
                            endpoint=endpoint, peer=peer, reason=reason)  # a monitor the endpoint


class _FoldedEvents:
    """Health events of one kind, at most one per key every REPORT_EVERY_S (the
    next one says how many were folded into it), each logged too; sent through
    a HeartbeatSender made at the first (none without a supervisor: a test, a
    tool). Used by one thread."""

    def __init__(self, event: str, says: str):
        self.event, self.says = event, says
        self._last: dict[tuple, list] = {}  # key -> [time reported, folded since]
        self._sender: HeartbeatSender | None = None

    def report(self, ctx: zmq.Context, key: tuple, **details) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < REPORT_EVERY_S:
            last[1] += 1
            return
        self._last[key] = [now, 0]
        details["folded"] = last[1] if last is not None else 0
        log.warning("%s: %s", self.says, details)
        if self._sender is None:
            self._sender = HeartbeatSender.from_env(ctx, _component)
        if self._sender is not None:
            self._sender.event(self.event, **details)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.socket.close(linger=0)


class Ignored:
    """A receiving socket's messages from members about what is not their own
    (ipc/sockets.py, `admit`): counted, and logged and reported (`peer_ignored`)
    at most once per member and reason every REPORT_EVERY_S. Used by the
    socket's own thread."""

    def __init__(self):
        self.count = 0
        self._events = _FoldedEvents("peer_ignored", "peer's message ignored")

    def note(self, sock: zmq.Socket, member: tuple[str, str], kind: str, reason: str) -> None:
        self.count += 1
        self._events.report(sock.context, (member, reason),
                            endpoint=sock.last_endpoint.decode(errors="replace"),
                            peer=member[0], message=kind, reason=reason)

    def close(self) -> None:
        self._events.close()
