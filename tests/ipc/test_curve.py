"""CURVE on tcp:// sockets (ipc/curve.py): real sockets on loopback, a real
supervisor inbox for the peer_refused events."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgspec
import pytest
import zmq

from deepserve.ipc import curve, curve_keys
from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket, SubSocket, free_port
from deepserve.messages.health import HealthEvent


class Ping(msgspec.Struct, tag=True):
    seq: int


NODE = "m1"


@pytest.fixture
def keys_dir(tmp_path):
    curve_keys.make_keys(tmp_path / "keys")
    curve_keys.make_node_key(tmp_path / "keys", NODE)
    return tmp_path / "keys"


def _as_node(monkeypatch, keys_dir, node: str = NODE) -> None:
    monkeypatch.setenv(curve.ENV_VAR, str(keys_dir))
    monkeypatch.setenv(curve.NODE_ENV_VAR, node)


@pytest.fixture
def secure(keys_dir, monkeypatch):
    """This process secure as node m1 (what `[cluster] secure` does to a node), a
    fresh context."""
    _as_node(monkeypatch, keys_dir)
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _refusals(inbox, want: int, timeout: float = 5.0) -> list[HealthEvent]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        try:
            msg = inbox.get(timeout=0.2)
        except TimeoutError:
            continue
        if isinstance(msg, HealthEvent) and msg.event == "peer_refused":
            got.append(msg)
    return got


def send_raw(host: str, port: int, payload: bytes) -> None:
    """Not even ZeroMQ: write `payload` on a plain TCP connection, read until the
    peer closes it (or 1 s of silence)."""
    with socket.create_connection((host, port), timeout=5) as raw:
        raw.sendall(payload)
        raw.settimeout(1)
        try:
            while raw.recv(4096):
                pass
        except (TimeoutError, ConnectionResetError):
            pass


def _refused_within(watch: curve.HandshakeWatch, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not watch.poll():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _outsider_push(address: str, keys: tuple[bytes, bytes] | None = None,
                   server_key: bytes | None = None) -> bool:
    """A process without our key sends a Ping; True when the send was queued."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 0
        if keys is not None:
            sock.curve_publickey, sock.curve_secretkey = keys
            sock.curve_serverkey = server_key
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(Ping(seq=666)))
        time.sleep(0.5)
        sock.close(linger=0)
    finally:
        ctx.term()
    return True


def test_make_keys_writes_a_pair_only_its_owner_reads_and_never_overwrites(keys_dir):
    secret = keys_dir / "cluster.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert (keys_dir / f"{NODE}.key_secret").stat().st_mode & 0o777 == 0o600
    keys = curve_keys.Keys.load(keys_dir, NODE)
    assert len(keys.public) == 40 and len(keys.secret) == 40
    assert keys.node_public != keys.public and len(keys.node_secret) == 40
    with pytest.raises(curve_keys.KeysError, match="already holds"):
        curve_keys.make_keys(keys_dir)
    with pytest.raises(curve_keys.KeysError, match="already holds a key for node"):
        curve_keys.make_node_key(keys_dir, NODE)
    assert curve_keys.Keys.load(keys_dir, NODE) == keys  # the pairs are untouched
    allowed = curve_keys.AllowList(keys_dir)
    assert allowed.member(keys.node_public) == (NODE, "")  # on the list, by its name
    assert allowed.member(keys.public) is None  # the server pair admits nobody


def test_keys_that_others_can_read_or_that_are_missing_are_refused(keys_dir, tmp_path):
    os.chmod(keys_dir / "cluster.key_secret", 0o644)
    with pytest.raises(curve_keys.KeysError, match="chmod 600"):
        curve_keys.Keys.load(keys_dir, NODE)
    with pytest.raises(curve_keys.KeysError, match="bin/deepserve-keys"):
        curve_keys.Keys.load(tmp_path / "nowhere", NODE)
    with pytest.raises(curve_keys.KeysError, match="--node m2"):  # no pair of its own
        os.chmod(keys_dir / "cluster.key_secret", 0o600)
        curve_keys.Keys.load(keys_dir, "m2")
    for bad in ("../m1", "x" * 65, "", "cluster"):  # 1-64 letters, digits, - and _
        with pytest.raises(curve_keys.KeysError, match="node name"):
            curve_keys.Keys.load(keys_dir, bad)
    curve_keys.make_node_key(keys_dir, "x" * 64)  # the longest name
    assert curve_keys.Keys.load(keys_dir, "x" * 64).node == "x" * 64
    other = tmp_path / "other"
    curve_keys.make_keys(other)
    os.replace(other / "cluster.key", keys_dir / "cluster.key")  # another pair's public half
    with pytest.raises(curve_keys.KeysError, match="not the public half"):
        curve_keys.Keys.load(keys_dir, NODE)


def test_cluster_members_talk_over_curve(secure):
    address = f"tcp://127.0.0.1:{free_port()}"
    pull = PullSocket(secure, address, bind=True, type=Ping)
    push = PushSocket(secure, address, bind=False)
    try:
        assert pull.socket.get(zmq.MECHANISM) == push.socket.get(zmq.MECHANISM) == zmq.CURVE
        assert pull.socket.curve_server and not push.socket.curve_server
        push.put(Ping(seq=7))
        assert pull.get(timeout=5) == Ping(seq=7)
    finally:
        push.close()
        pull.close()


def test_ipc_sockets_stay_plain_in_a_secure_process(secure, short_dir):
    address = f"ipc://{short_dir}/plain.sock"
    pull = PullSocket(secure, address, bind=True, type=Ping)
    try:
        assert not pull.socket.curve_server
        assert not pull.socket.get(zmq.MECHANISM)  # NULL
    finally:
        pull.close()


@pytest.mark.parametrize("outsider", ["no CURVE", "its own key", "guessed server key"])
def test_a_peer_without_the_cluster_key_is_refused_and_reported(secure, supervisor_inbox,
                                                                  outsider):
    """The fault: an outsider's message to a bound socket. Proven by the guard's
    own count and event; then: nothing reached the socket."""
    address = f"tcp://127.0.0.1:{free_port()}"
    pull = PullSocket(secure, address, bind=True, type=Ping)
    keys = curve.active()
    own = zmq.curve_keypair()
    try:
        if outsider == "no CURVE":
            _outsider_push(address)
        elif outsider == "its own key":  # knows our public key, holds another secret
            _outsider_push(address, own, keys.public)
        else:
            _outsider_push(address, own, zmq.curve_keypair()[0])
        [event] = _refusals(supervisor_inbox.inbox, 1)
        guard = curve.Guard.of(secure, keys)
        assert guard.num_refused >= 1
        assert event.pid == os.getpid() and event.details["reason"]
        if outsider == "its own key":  # ZAP names the peer
            assert event.details["peer"] == "127.0.0.1"
            assert event.details["reason"] == curve.NOT_ALLOWED
        else:  # the monitor names our endpoint
            assert event.details["endpoint"] == address
        with pytest.raises(TimeoutError):  # nothing got in
            pull.get(timeout=0.5)
    finally:
        pull.close()


def test_refusals_of_one_kind_are_folded_into_one_event_per_interval(secure, supervisor_inbox):
    address = f"tcp://127.0.0.1:{free_port()}"
    pull = PullSocket(secure, address, bind=True, type=Ping)
    outsiders, socks = zmq.Context(), []
    try:
        for _ in range(6):  # six outsiders, each with a key of its own
            s = outsiders.socket(zmq.PUSH)
            socks.append(s)  # kept: a collected socket closes
            s.linger = 0
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
            s.curve_serverkey = curve.active().public
            s.connect(address)
        guard = curve.Guard.of(secure, curve.active())
        deadline = time.monotonic() + 5
        while guard.num_refused < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.num_refused >= 6  # the fault, six times
        [event] = _refusals(supervisor_inbox.inbox, 2, timeout=1.0)
        assert event.details["reason"] == curve.NOT_ALLOWED
    finally:
        outsiders.destroy(linger=0)
        pull.close()


def test_a_context_with_a_guard_terminates_at_once(keys_dir, monkeypatch):
    _as_node(monkeypatch, keys_dir)
    ctx = zmq.Context()
    pull = PullSocket(ctx, f"tcp://127.0.0.1:{free_port()}", bind=True, type=Ping)
    guard = curve.Guard.of(ctx, curve.active())
    pull.close()
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(5), "ctx.term() waited on the guard"
    guard._thread.join(5)
    assert not guard._thread.is_alive()


def test_without_keys_tcp_sockets_stay_plain(monkeypatch):
    monkeypatch.delenv(curve.ENV_VAR, raising=False)
    ctx = zmq.Context()
    try:
        pull = PullSocket(ctx, f"tcp://127.0.0.1:{free_port()}", bind=True, type=Ping)
        assert not pull.socket.curve_server
        pull.close()
    finally:
        ctx.term()


def test_a_secure_client_learns_that_a_plain_server_is_not_its_cluster(keys_dir, monkeypatch):
    """A secure node joining a head left without [cluster] secure: refused, and why."""
    monkeypatch.delenv(curve.ENV_VAR, raising=False)
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    pub = PubSocket(ctx, address, bind=True)  # a plain head's TE lists
    _as_node(monkeypatch, keys_dir)
    sub = SubSocket(ctx, address, bind=False, type=Ping, watch_handshakes=True)
    try:
        assert _refused_within(sub.handshakes, 10), sub.handshakes.reason
        assert "secure" in sub.handshakes.reason
        pub.put(Ping(seq=1))
        with pytest.raises(TimeoutError):  # and nothing it is sent gets through
            sub.get(timeout=0.5)
    finally:
        sub.close()
        pub.close()
        ctx.term()


def test_the_same_outsider_gets_in_where_the_process_is_not_secure(monkeypatch):
    """The control for the refusals above: without keys, a bound tcp:// socket
    takes the outsider's message."""
    monkeypatch.delenv(curve.ENV_VAR, raising=False)
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    pull = PullSocket(ctx, address, bind=True, type=Ping)
    try:
        _outsider_push(address)
        assert pull.get(timeout=5) == Ping(seq=666)
    finally:
        pull.close()
        ctx.term()


@pytest.mark.parametrize("client", ["plain", "other key"])
def test_a_refused_client_learns_why_from_its_handshake_watch(secure, keys_dir, tmp_path,
                                                             monkeypatch, client):
    """What a joining node reads off its socket to the head's TE lists (supervisor/node.py)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    pub = PubSocket(secure, address, bind=True)  # a secure head
    if client == "plain":
        monkeypatch.delenv(curve.ENV_VAR)
    else:
        curve_keys.make_keys(tmp_path / "other")
        curve_keys.make_node_key(tmp_path / "other", NODE)
        _as_node(monkeypatch, tmp_path / "other")
    ctx = zmq.Context()
    sub = SubSocket(ctx, address, bind=False, type=Ping, watch_handshakes=True)
    try:
        assert _refused_within(sub.handshakes, 10), sub.handshakes.reason
        assert ("secure" if client == "plain" else "key") in sub.handshakes.reason
    finally:
        sub.close()
        ctx.term()
        pub.close()


def test_a_member_is_never_refused_and_its_watch_sees_no_failure(secure, supervisor_inbox):
    """The head's side of a joining node's watch: no broken-off handshake to report
    (CI once saw one when the watch re-dialled a socket mid-handshake)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    pub = PubSocket(secure, address, bind=True)
    subs = [SubSocket(secure, address, bind=False, type=Ping, watch_handshakes=True)
            for _ in range(4)]
    try:
        deadline = time.monotonic() + 5
        got = 0
        while got < 4 and time.monotonic() < deadline:
            pub.put(Ping(seq=1))
            got = sum(1 for s in subs if s.poll(0.05) and s.get(timeout=0))
        assert got == 4
        assert not any(s.handshakes.poll() for s in subs)
        assert curve.Guard.of(secure, curve.active()).num_refused == 0
        assert not _refusals(supervisor_inbox.inbox, 1, timeout=0.5)
    finally:
        for s in subs:
            s.close()
        pub.close()


def test_raw_bytes_on_a_secure_port_are_refused_and_members_still_get_in(secure,
                                                                         supervisor_inbox):
    """Not even ZeroMQ: a TCP peer writing garbage, then one greeting and hanging up."""
    address = f"tcp://127.0.0.1:{free_port()}"
    host, port = address[len("tcp://"):].split(":")
    pull = PullSocket(secure, address, bind=True, type=Ping)
    push = PushSocket(secure, address, bind=False)
    try:
        guard = curve.Guard.of(secure, curve.active())
        for payload in (os.urandom(4096), b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16)):
            send_raw(host, int(port), payload)
        deadline = time.monotonic() + 5
        while guard.num_refused < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.num_refused >= 1  # the fault reached the guard
        push.put(Ping(seq=3))
        assert pull.get(timeout=5) == Ping(seq=3)
        assert guard._thread.is_alive()
    finally:
        push.close()
        pull.close()


def test_a_watch_counts_a_refusal_at_the_third_handshake_broken_off():
    """BROKEN_OFF_AFTER at its boundary, against a real peer that accepts each
    connection and closes it (no detail: a reset could be one): two broken-off
    handshakes are not a refusal yet, the third is."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    allowed = threading.Semaphore(0)

    def accept_and_close() -> None:
        while allowed.acquire(timeout=10):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()
    threading.Thread(target=accept_and_close, daemon=True).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    watch = curve.HandshakeWatch(sub)
    sub.connect(f"tcp://127.0.0.1:{server.getsockname()[1]}")
    try:
        def seen(n: int) -> bool:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                refused = watch.poll()
                if watch.num_failed >= n:
                    return refused
                time.sleep(0.01)
            raise AssertionError(f"{watch.num_failed} broken-off handshakes, want {n}")
        allowed.release()
        allowed.release()
        assert curve.HandshakeWatch.BROKEN_OFF_AFTER == 3
        assert seen(2) is False and watch.num_failed == 2
        assert not watch.definite and "broke the handshake off" in watch.reason
        allowed.release()
        assert seen(3) is True and watch.num_failed == 3
    finally:
        watch.close()
        sub.close()
        ctx.term()
        server.close()
