"""Fork (cache/weight_fork.py): a model's files pulled from a peer's
WeightServer over tcp on loopback; a peer killed mid-copy (a real process,
SIGKILL by its pid) gives way to the next source; what a server refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from deepserve.cache.weight_fork import ForkError, Partial, WeightServer, fork_model
from deepserve.ipc import curve, curve_keys
from deepserve.ipc.sockets import free_port
from deepserve.messages.weights import WeightChunk, WeightFiles, WeightGet, WeightList

SERVE = """
import sys, time, zmq
from pathlib import Path
from deepserve.cache.weight_fork import WeightServer
class Slow(WeightServer):  # a slow link: the copy is surely under way when it is killed
    def _answer(self, msg):
        time.sleep(0.02)
        return super()._answer(msg)
Slow(zmq.Context(), sys.argv[1], lambda: {"/m": Path(sys.argv[2])})
print("up", flush=True)
time.sleep(120)
"""


def _model(d: Path, big: int = 0) -> Path:
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(os.urandom(big or 3 * 1024 * 1024 + 17))
    (d / "empty.txt").write_bytes(b"")
    return d


def _same(a: Path, b: Path) -> bool:
    return sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir()) and all(
        (a / p.name).read_bytes() == (b / p.name).read_bytes() for p in a.iterdir())


def test_a_fork_copies_every_file_whole(tmp_path):
    src = _model(tmp_path / "src")
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = WeightServer(ctx, address, lambda: {"/m": src})
    try:
        got = fork_model(ctx, [address], "/m", tmp_path / "dest", chunk=1 << 20)
        assert _same(src, tmp_path / "dest") and got.source == address
        assert got.bytes == server.num_served == sum(f.stat().st_size for f in src.iterdir())
        assert [p.name for p in tmp_path.iterdir() if ".part-" in p.name] == []
        with pytest.raises(ForkError, match="not held here"):
            fork_model(ctx, [address], "/other", tmp_path / "x")
        assert not (tmp_path / "x").exists()
    finally:
        server.stop()
        ctx.term()


def test_a_peer_killed_mid_copy_gives_way_to_the_next_source(tmp_path):
    src = _model(tmp_path / "src", big=96 << 20)
    ctx = zmq.Context()
    first, second = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    peer = subprocess.Popen([sys.executable, "-c", SERVE, first, str(src)],
                            stdout=subprocess.PIPE, text=True)
    server = WeightServer(ctx, second, lambda: {"/m": src})
    try:
        assert peer.stdout.readline().strip() == "up"
        out: dict = {}
        fork = threading.Thread(target=lambda: out.update(r=fork_model(
            ctx, [first, second], "/m", tmp_path / "dest", timeout_s=1.0, chunk=256 << 10)))
        fork.start()
        deadline = time.monotonic() + 30
        while not any(p.stat().st_size and ".part-" in p.parent.name
                      for p in tmp_path.glob(".dest.part-*/*")):
            assert time.monotonic() < deadline and fork.is_alive()
            time.sleep(0.005)
        os.kill(peer.pid, signal.SIGKILL)  # mid-copy: the fault
        assert peer.wait(10) == -signal.SIGKILL
        fork.join(60)
        assert out["r"].source == second and _same(src, tmp_path / "dest")
        assert server.num_served == out["r"].bytes  # the whole model again, from the second
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        server.stop()
        ctx.term()


def test_the_server_refuses_what_it_does_not_hold_and_lives(tmp_path):
    src = _model(tmp_path / "src")
    (tmp_path / "secret").write_text("no")
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = WeightServer(ctx, address, lambda: {"/m": src})
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(WeightFiles | WeightChunk)
    try:
        sock.send(b"\x00garbage")  # dropped, no answer; the server goes on
        for bad in (WeightGet(path="/m", name="../secret", offset=0, length=2),
                    WeightGet(path="/m", name="config.json", offset=-1, length=2),
                    WeightGet(path="/m", name="config.json", offset=0, length=0),
                    WeightGet(path="/m", name="config.json", offset=0, length=(16 << 20) + 1)):
            sock.send(enc.encode(bad))
            assert sock.poll(5000)
            assert dec.decode(sock.recv_multipart()[0]).error, bad
        sock.send(enc.encode(WeightGet(path="/m", name="config.json", offset=0,
                                       length=16 << 20)))  # the limit itself: served
        assert sock.poll(5000)
        header, data = sock.recv_multipart()
        assert not dec.decode(header).error and data == b'{"a": 1}'
        sock.send(enc.encode(WeightList(path="/m")))
        assert sock.poll(5000)
        assert [n for n, _ in dec.decode(sock.recv_multipart()[0]).files] == [
            "config.json", "empty.txt", "model.safetensors"]
    finally:
        sock.close()
        server.stop()
        ctx.term()


def test_with_the_cluster_key_members_fork_over_curve_and_an_outsider_gets_nothing(
        tmp_path, monkeypatch):
    """[cluster] secure: the weight server is a CURVE server like every tcp://
    socket of a secure node; a member forks, a process without the key gets
    no byte (no answer, no progress: ForkError), and the server goes on serving."""
    src = _model(tmp_path / "src")
    curve_keys.make_keys(tmp_path / "keys")
    curve_keys.make_node_key(tmp_path / "keys", "w")
    monkeypatch.setenv(curve.ENV_VAR, str(tmp_path / "keys"))
    monkeypatch.setenv(curve.NODE_ENV_VAR, "w")
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = WeightServer(ctx, address, lambda: {"/m": src})
    try:
        monkeypatch.delenv(curve.ENV_VAR)  # the outsider: no key
        outsider = zmq.Context()
        with pytest.raises(ForkError, match="no progress"):
            fork_model(outsider, [address], "/m", tmp_path / "stolen", timeout_s=1.0)
        outsider.term()
        assert not (tmp_path / "stolen").exists() and server.num_served == 0
        monkeypatch.setenv(curve.ENV_VAR, str(tmp_path / "keys"))  # a member
        got = fork_model(ctx, [address], "/m", tmp_path / "dest")
        assert _same(src, tmp_path / "dest") and got.bytes == server.num_served
    finally:
        server.stop()
        ctx.destroy(linger=0)


class _Slow(WeightServer):
    def _answer(self, msg):
        time.sleep(0.01)
        return super()._answer(msg)


def test_a_node_relays_its_fork_under_way_and_the_source_sends_the_model_once(tmp_path):
    """A chain: A forks from the source, B from A while A's copy is under way
    (A's server relays the chunks A has, `retry` for the rest). Both copies
    are whole; the source sent the model once, A sent it to B."""
    src = _model(tmp_path / "src", big=8 << 20)
    nbytes = sum(f.stat().st_size for f in src.iterdir())
    ctx = zmq.Context()
    source, relay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    up = _Slow(ctx, source, lambda: {"/m": src})
    partial = Partial()
    whole_a = lambda: {"/m": tmp_path / "a"} if (tmp_path / "a").is_dir() else {}  # noqa: E731
    a = WeightServer(ctx, relay, whole_a, lambda: {"/m": partial})  # as NodeModels: then whole
    out: dict = {}
    try:
        fork_a = threading.Thread(target=lambda: out.update(a=fork_model(
            ctx, [source], "/m", tmp_path / "a", chunk=256 << 10, partial=partial)))
        fork_a.start()
        deadline = time.monotonic() + 30
        while not partial.have:  # A has begun
            assert time.monotonic() < deadline and fork_a.is_alive()
            time.sleep(0.005)
        out["b"] = fork_model(ctx, [relay, source], "/m", tmp_path / "b", chunk=256 << 10)
        fork_a.join(30)
        assert out["b"].source == relay
        assert _same(src, tmp_path / "a") and _same(src, tmp_path / "b")
        assert up.num_served == nbytes and a.num_served == nbytes  # each byte left the source once
        assert a.num_relayed > 0  # some of it while A's own copy was under way
        assert partial.have == {} and partial.files is None  # A's copy whole: served as such
    finally:
        up.stop()
        a.stop()
        ctx.term()


def test_a_relay_that_stops_progressing_gives_way_to_the_next_source(tmp_path):
    """A relay whose listing never comes (its own source is gone): the asker
    gives up on it after timeout_s and forks from the next source."""
    src = _model(tmp_path / "src")
    ctx = zmq.Context()
    relay, other = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    stuck = WeightServer(ctx, relay, dict, lambda: {"/m": Partial()})  # no listing, ever
    whole = WeightServer(ctx, other, lambda: {"/m": src})
    try:
        started = time.monotonic()
        got = fork_model(ctx, [relay, other], "/m", tmp_path / "dest", timeout_s=1.0)
        assert got.source == other and _same(src, tmp_path / "dest")
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        stuck.stop()
        whole.stop()
        ctx.term()


def _lying_peer(ctx, files):
    """A peer that answers every WeightList with `files` (names and sizes of its
    choosing) and every WeightGet with an error; (address, stop)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    stop = threading.Event()
    enc = msgspec.msgpack.Encoder()

    def serve():
        while not stop.is_set():
            if sock.poll(50):
                who, _ = sock.recv_multipart()
                sock.send_multipart([who, enc.encode(WeightFiles(files=files))])
        sock.close()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return address, lambda: (stop.set(), thread.join(5))


@pytest.mark.parametrize("files, why", [
    ([("model.safetensors", 1 << 60)], "free here"),  # a petabyte-scale listing
    ([("a", 1), ("a", 1)], "twice"),
    ([("x" * 256, 1)], "bad file name"),
    ([("a\x00b", 1)], "bad file name"),
    ([(f"f{i}", 0) for i in range(4097)], "at most 4096"),  # one past MAX_FILES
])
def test_a_listing_no_model_could_have_is_refused_before_anything_is_laid_out(
        tmp_path, files, why):
    ctx = zmq.Context()
    address, stop = _lying_peer(ctx, files)
    try:
        with pytest.raises(ForkError, match=why):
            fork_model(ctx, [address], "/m", tmp_path / "dest", timeout_s=5.0)
        assert list(tmp_path.iterdir()) == []  # no file, no temp directory left
    finally:
        stop()
        ctx.term()


def test_a_listing_at_the_file_limit_is_taken(tmp_path):
    ctx = zmq.Context()
    address, stop = _lying_peer(ctx, [(f"f{i}", 0) for i in range(4096)])
    try:
        fork_model(ctx, [address], "/m", tmp_path / "dest", timeout_s=5.0)
        assert len(list((tmp_path / "dest").iterdir())) == 4096
    finally:
        stop()
        ctx.term()
