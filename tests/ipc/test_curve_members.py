"""Who gets in under CURVE (ipc/curve.py, ipc/curve_keys.py): only keys on the
allow-list, each known by its node's name, revoked live; a recorded session
replayed gets nothing in. Real sockets on loopback."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq

from deepserve.ipc import curve, curve_keys
from deepserve.ipc.sockets import PullSocket, free_port
from tests.ipc.test_curve import send_raw


class Ping(msgspec.Struct, tag=True):
    seq: int


@pytest.fixture
def keys_dir(tmp_path):
    d = tmp_path / "keys"
    curve_keys.make_keys(d)
    curve_keys.make_node_key(d, "server")
    curve_keys.make_node_key(d, "head0", head=True)
    curve_keys.make_node_key(d, "n1")
    return d


@pytest.fixture
def server(keys_dir, monkeypatch):
    """A secure PULL on loopback in this process (node "server"); yields
    (socket, address, guard)."""
    monkeypatch.setenv(curve.ENV_VAR, str(keys_dir))
    monkeypatch.setenv(curve.NODE_ENV_VAR, "server")
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    pull = PullSocket(ctx, address, bind=True, type=Ping)
    yield pull, address, curve.Guard.of(ctx, curve.active())
    pull.close()
    ctx.destroy(linger=0)


def _client(address: str, public: bytes, secret: bytes, server_key: bytes,
            seq: int) -> None:
    """Another process's view: a PUSH with this key pair sends Ping(seq)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 0
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = \
            public, secret, server_key
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(Ping(seq=seq)))
        time.sleep(0.3)
        sock.close(linger=0)
    finally:
        ctx.term()


def _node(keys_dir, name: str) -> curve_keys.Keys:
    return curve_keys.Keys.load(keys_dir, name)


def _refusals_reach(guard, n: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while guard.num_refused < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return guard.num_refused >= n


def test_each_member_is_known_by_its_name_and_role(server, keys_dir):
    pull, address, guard = server
    for seq, name in enumerate(("n1", "head0")):
        keys = _node(keys_dir, name)
        _client(address, keys.node_public, keys.node_secret, keys.public, seq)
        assert pull.poll(5)
        frame = pull.socket.recv(copy=False)
        assert msgspec.msgpack.decode(frame.bytes, type=Ping) == Ping(seq=seq)
        assert curve.peer(frame) == (name, "head" if name == "head0" else "")
    assert guard.num_refused == 0


def test_a_key_off_the_list_is_refused_even_the_clusters_own_pair(server, keys_dir):
    """The cluster's server pair (every host holds it) is no member's key: a
    leaked cluster secret lets nobody in as a client."""
    pull, address, guard = server
    keys = _node(keys_dir, "n1")
    _client(address, keys.public, keys.secret, keys.public, 1)
    assert _refusals_reach(guard, 1)  # the fault: ZAP said no
    with pytest.raises(TimeoutError):
        pull.get(timeout=0.5)


def test_a_revoked_node_is_refused_from_its_next_connection_without_a_restart(
        server, keys_dir):
    pull, address, guard = server
    keys = _node(keys_dir, "n1")
    _client(address, keys.node_public, keys.node_secret, keys.public, 1)
    assert pull.get(timeout=5) == Ping(seq=1)  # a member before
    assert curve_keys.revoke(keys_dir, "n1") and not curve_keys.revoke(keys_dir, "n1")
    _client(address, keys.node_public, keys.node_secret, keys.public, 2)
    assert _refusals_reach(guard, 1)  # the fault: its key, refused now
    with pytest.raises(TimeoutError):
        pull.get(timeout=0.5)
    other = _node(keys_dir, "head0")  # the others still get in
    _client(address, other.node_public, other.node_secret, other.public, 3)
    assert pull.get(timeout=5) == Ping(seq=3)


def test_a_damaged_allow_list_file_admits_nobody_and_the_rest_stand(server, keys_dir):
    pull, address, guard = server
    (keys_dir / "allowed" / "n1.key").write_text("metadata\ncurve\n    public-key = \"\n")
    keys = _node(keys_dir, "n1")
    _client(address, keys.node_public, keys.node_secret, keys.public, 1)
    assert _refusals_reach(guard, 1)
    head = _node(keys_dir, "head0")
    _client(address, head.node_public, head.node_secret, head.public, 2)
    assert pull.get(timeout=5) == Ping(seq=2)


def test_a_recorded_session_replayed_gets_nothing_in(server, keys_dir):
    """A member's whole session through a recording relay, then its bytes sent
    again on a new connection: CURVE's handshake is bound to the server's fresh
    keys of each connection, so the replay fails there (counted by the guard)
    and the message is delivered once."""
    pull, address, guard = server
    host, port = address[len("tcp://"):].split(":")
    relay = socket.socket()
    relay.bind(("127.0.0.1", 0))
    relay.listen(1)
    recorded = bytearray()

    def pump(src, dst, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    recorded.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        conn, _ = relay.accept()
        upstream = socket.create_connection((host, int(port)), timeout=5)
        threading.Thread(target=pump, args=(upstream, conn, False), daemon=True).start()
        pump(conn, upstream, True)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    keys = _node(keys_dir, "n1")
    _client(f"tcp://127.0.0.1:{relay.getsockname()[1]}", keys.node_public, keys.node_secret,
            keys.public, 7)
    assert pull.get(timeout=5) == Ping(seq=7)
    t.join(5)
    relay.close()
    assert len(recorded) > 200  # greeting, HELLO, INITIATE and the message
    send_raw(host, int(port), bytes(recorded))
    assert _refusals_reach(guard, 1)  # the fault reached the server and was refused
    with pytest.raises(TimeoutError):  # delivered once, never twice
        pull.get(timeout=0.5)


def test_a_members_message_about_what_is_not_its_own_is_ignored_and_counted(
        keys_dir, monkeypatch, supervisor_inbox):
    """The cluster manager's inbox with its admit (control/identity.py): n1 may
    announce n1-te0, not n2-te0, nor send the JE's demand; a head may. The
    fault is proven by the socket's own count and its peer_ignored event."""
    from deepserve.control.identity import cm_admit
    from deepserve.messages.control import TEInfo, TEUp, ToClusterManager
    from deepserve.messages.scaling import ModelDemand
    monkeypatch.setenv(curve.ENV_VAR, str(keys_dir))
    monkeypatch.setenv(curve.NODE_ENV_VAR, "server")
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    inbox = PullSocket(ctx, address, bind=True, type=ToClusterManager, admit=cm_admit)

    def up(te_id: str) -> TEUp:
        return TEUp(info=TEInfo(te_id=te_id, model="m", address="tcp://x:1"))
    try:
        n1, head = _node(keys_dir, "n1"), _node(keys_dir, "head0")
        sent = [(n1, up("n2-te0")), (n1, ModelDemand(arrivals={"m": 9})), (n1, up("n1-te0")),
                (head, up("te0")), (head, ModelDemand(arrivals={"m": 1}))]
        for keys, msg in sent:
            _send(address, keys, msg)
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            got += inbox.drain()
            time.sleep(0.05)
        assert sorted(map(repr, got)) == sorted(map(repr, [
            up("n1-te0"), up("te0"), ModelDemand(arrivals={"m": 1})]))
        assert inbox.num_ignored == 2
        events = []
        deadline = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < deadline:
            try:
                msg = supervisor_inbox.inbox.get(timeout=0.2)
            except TimeoutError:
                continue
            if getattr(msg, "event", "") == "peer_ignored":
                events.append(msg.details)
        assert {(e["peer"], e["message"]) for e in events} == {("n1", "TEUp"),
                                                              ("n1", "ModelDemand")}
        assert "n2-te0" in events[0]["reason"] or "n2-te0" in events[1]["reason"]
    finally:
        inbox.close()
        ctx.destroy(linger=0)


def _send(address: str, keys: curve_keys.Keys, msg) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 1000
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = \
            keys.node_public, keys.node_secret, keys.public
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(msg))
        time.sleep(0.2)
        sock.close()
    finally:
        ctx.term()
