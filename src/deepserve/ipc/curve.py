"""CURVE on every ZeroMQ socket that crosses hosts ([cluster] secure = true).

    bin/deepserve-keys DIR    DIR/cluster.key (public), DIR/cluster.key_secret (0600):
                              one key pair per cluster, copied to every host that may join
    a secure process          $DEEPSERVE_CURVE_KEYS = DIR (the node sets it; children inherit)
      tcp:// bound            CURVE server with the cluster key, ZAP domain "deepserve",
                              ZAP enforced (no handler: no peer gets in)
      tcp:// connected        CURVE client with the cluster key pair, the server key the
                              cluster's public key
      ipc://, inproc://       as they were (one host: the file system guards them)

Every ZeroMQ context that binds a secure socket gets one Guard thread:
    ZAP handler   a CURVE client whose key is not the cluster's -> refused (400)
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
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from deepserve.ipc.heartbeat import HeartbeatSender

log = logging.getLogger(__name__)
ENV_VAR = "DEEPSERVE_CURVE_KEYS"
KEY_NAME = "cluster"
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


class KeysError(ValueError):
    """The cluster keys are missing, malformed, or readable by others."""


@dataclass(frozen=True)
class Keys:
    """The cluster's key pair (Z85, as ZeroMQ takes them)."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, directory: str | Path) -> Keys:
        d = Path(directory)
        public_file, secret_file = d / f"{KEY_NAME}.key", d / f"{KEY_NAME}.key_secret"
        if not secret_file.is_file():
            raise KeysError(f"{secret_file}: no cluster key; make one with "
                            f"bin/deepserve-keys {d} and copy {d} to every host")
        mode = secret_file.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeysError(f"{secret_file}: readable by others (mode {oct(mode & 0o777)}); "
                            f"chmod 600 it")
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
            if public_file.is_file() and zmq.auth.load_certificate(public_file)[0] != public:
                raise KeysError(f"{public_file}: not the public half of {secret_file}")
        except (OSError, ValueError) as e:  # KeysError is a ValueError: re-raised as is
            raise e if isinstance(e, KeysError) else KeysError(f"{d}: {e}") from None
        if not secret or len(public) != 40 or len(secret) != 40:
            raise KeysError(f"{secret_file}: not a CURVE key pair")
        return cls(public=public, secret=secret)


def make_keys(directory: str | Path) -> Path:
    """A new cluster key pair in `directory` (made if missing; an existing pair
    is an error: replacing it locks every host out). The secret file gets 0600."""
    d = Path(directory)
    if (d / f"{KEY_NAME}.key_secret").exists():
        raise KeysError(f"{d}: already holds a cluster key; remove it first to make a new one")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    old = os.umask(0o077)
    try:
        _, secret_file = zmq.auth.create_certificates(d, KEY_NAME)
    finally:
        os.umask(old)
    os.chmod(secret_file, 0o600)
    return Path(secret_file)


# -- the process's policy ---------------------------------------------------------------
_loaded: dict[str, Keys] = {}
_component = f"pid{os.getpid()}"


def enable(directory: str | Path) -> Keys:
    """Make this process and every child it starts from now on secure: checks the
    keys (KeysError) and sets $DEEPSERVE_CURVE_KEYS."""
    keys = Keys.load(directory)
    os.environ[ENV_VAR] = str(Path(directory).resolve())
    return keys


def active() -> Keys | None:
    """The keys this process secures tcp:// sockets with, or None (not secure)."""
    directory = os.environ.get(ENV_VAR)
    if not directory:
        return None
    keys = _loaded.get(directory)
    if keys is None:
        keys = _loaded[directory] = Keys.load(directory)
    return keys


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
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    if not bind:
        sock.curve_serverkey = keys.public
        return
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
                reason = "it refused our key: not its cluster's"
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
        self._ctx = zmq.Context.shadow(ctx.underlying)
        self._key = ctx.underlying
        self._zap = self._ctx.socket(zmq.REP)  # bound before any secure socket of ctx
        self._zap.linger = 0
        self._zap.bind(ZAP_ADDRESS)
        self._new: queue.SimpleQueue = queue.SimpleQueue()  # monitor PAIRs for the thread
        self._last: dict[tuple[str, str], list] = {}  # (endpoint, reason) -> [time, folded]
        self.num_refused = 0
        self._reporter: HeartbeatSender | None = None  # the guard thread's, made at need
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
            if self._reporter is not None:
                self._reporter.socket.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        """ZAP (RFC 27): version, request id, domain, address, identity, mechanism,
        credentials -> version, request id, status, text, user id, metadata."""
        if len(frames) < 6:  # not from libzmq; a REP answers every request all the same
            self._zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400",
                                      b"bad ZAP request", b"", b""])
            return
        version, request_id, _, address, _, mechanism = frames[:6]
        ok = mechanism == b"CURVE" and len(frames) > 6 \
            and zmq.utils.z85.encode(frames[6]) == self.keys.public
        self._zap.send_multipart([version, request_id, b"200" if ok else b"400",
                                  b"OK" if ok else b"not a cluster key", b"peer" if ok else b"",
                                  b""])
        if not ok:
            self._refused("", address.decode(errors="replace"),
                          "CURVE key not the cluster's" if mechanism == b"CURVE"
                          else f"mechanism {mechanism.decode(errors='replace')}")

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
        now = time.monotonic()
        key = (endpoint or peer, reason)  # ZAP names the peer, a monitor the endpoint
        last = self._last.get(key)
        if last is not None and now - last[0] < REPORT_EVERY_S:
            last[1] += 1
            return
        folded = last[1] if last is not None else 0
        self._last[key] = [now, 0]
        details = {"endpoint": endpoint, "peer": peer, "reason": reason, "folded": folded}
        log.warning("peer refused: %s", details)
        if self._reporter is None:
            self._reporter = HeartbeatSender.from_env(self._ctx, _component)
        if self._reporter is not None:  # None: no supervisor (a test, a tool)
            self._reporter.event("peer_refused", **details)
