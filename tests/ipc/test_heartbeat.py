"""HeartbeatSender over a real zmq ipc socket: rate limit, env, never blocking."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from deepserve.ipc.sockets import PullSocket, ipc_address
from deepserve.messages.health import Heartbeat, Ready, ToSupervisor
from deepserve.ipc import heartbeat as hb_mod
from deepserve.ipc.heartbeat import ENV_VAR, HeartbeatSender


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def inbox(ctx, short_dir):
    pull = PullSocket(ctx, ipc_address(short_dir, "hb"), bind=True, type=ToSupervisor)
    yield pull
    pull.close()


class FakeTime:
    def __init__(self) -> None:
        self.now = 50.0

    def monotonic(self) -> float:
        return self.now


def _wait_connected(sender: HeartbeatSender, inbox: PullSocket) -> None:
    """IMMEDIATE drops until the pipe is up; force beats until one arrives."""
    deadline = time.monotonic() + 5
    while not sender.beat({}, False, force=True) or not inbox.poll(0.05):
        assert time.monotonic() < deadline, "heartbeat socket never connected"
    inbox.drain()


def test_roundtrip_and_rate_limit(ctx, inbox, monkeypatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(hb_mod, "time", fake)
    with HeartbeatSender(ctx, inbox.socket.last_endpoint.decode(), "te0/worker0",
                         interval_s=0.5) as sender:
        _wait_connected(sender, inbox)
        got = []

        def sent(ok: bool) -> bool:
            if ok:
                got.append(inbox.get(timeout=5))
            return ok

        fake.now += 1.0
        assert sent(sender.beat({"steps": 1}, True))
        for i in range(100):  # not due: nothing sent, however often it is called
            fake.now += 0.004
            assert not sent(sender.beat({"steps": 1 + i}, True))
        fake.now += 0.2
        assert sent(sender.beat({"steps": 7, "tokens": 30}, True, details={"batch": 4}))
        assert not sent(sender.beat({"steps": 8}, True))
        assert sent(sender.beat({"steps": 8}, True, force=True))
        assert sent(sender.beat({"steps": 8}, False))  # holds_work flipped: due at once
        assert sent(sender.ready({"port": 1}))
    assert [type(m) for m in got] == [Heartbeat] * 4 + [Ready]
    first = got[0]
    assert (first.component, first.pid, first.progress, first.holds_work) \
        == ("te0/worker0", os.getpid(), {"steps": 1}, True)
    assert first.time == 51.0
    assert got[1].progress == {"steps": 7, "tokens": 30} and got[1].details == {"batch": 4}
    assert [m.holds_work for m in got[:4]] == [True, True, True, False]
    assert got[4].details == {"port": 1}
    assert not inbox.poll(0.05)


def test_ready_sent_right_after_connecting_arrives(ctx, inbox) -> None:
    """Ready is sent once, as soon as the actor is up, i.e. typically before
    the pipe is connected: it waits for the connection instead of being
    dropped (a lost Ready left a pre-warmed pod never counted warm)."""
    for i in range(20):
        with HeartbeatSender(ctx, inbox.socket.last_endpoint.decode(), f"pod{i}") as sender:
            assert sender.ready({"n": i}) and sender.num_dropped == 0
        got = inbox.get(timeout=5)
        assert isinstance(got, Ready)
        assert (got.component, got.pid, got.details) == (f"pod{i}", os.getpid(), {"n": i})


def test_real_interval(ctx, inbox) -> None:
    with HeartbeatSender(ctx, inbox.socket.last_endpoint.decode(), "je",
                         interval_s=0.05) as sender:
        _wait_connected(sender, inbox)
        start = time.monotonic()
        while time.monotonic() - start < 0.3:
            sender.beat({"tasks_done": 1}, False)
        n = len(inbox.drain())
    assert 3 <= n <= 8  # ~6 in 0.3 s at 0.05 s, not thousands


def test_from_env(ctx, short_dir, monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert HeartbeatSender.from_env(ctx, "je") is None
    monkeypatch.setenv(ENV_VAR, "")
    assert HeartbeatSender.from_env(ctx, "je") is None
    address = ipc_address(short_dir, "env")
    monkeypatch.setenv(ENV_VAR, address)
    sender = HeartbeatSender.from_env(ctx, "je", interval_s=0.25)
    try:
        assert (sender.address, sender.component, sender.interval_s) == (address, "je", 0.25)
    finally:
        sender.close()


def test_never_blocks_without_a_listener(ctx, short_dir) -> None:
    with HeartbeatSender(ctx, ipc_address(short_dir, "nobody"), "te0/master") as sender:
        start = time.monotonic()
        for i in range(1000):
            sender.beat({"steps": i}, True, force=True)
        assert time.monotonic() - start < 1.0
        assert sender.num_sent + sender.num_dropped == 1000
        assert sender.num_dropped >= 990  # nothing queues without a peer


def test_drops_when_the_supervisor_does_not_read(ctx, inbox) -> None:
    with HeartbeatSender(ctx, inbox.socket.last_endpoint.decode(), "te0/master") as sender:
        _wait_connected(sender, inbox)
        start = time.monotonic()
        for i in range(20_000):
            sender.beat({"steps": i}, True, force=True)
        assert time.monotonic() - start < 2.0
        assert sender.num_dropped > 0
        msgs = inbox.drain()
    assert 0 < len(msgs) < 20_000


def test_wire_format_is_tagged() -> None:
    data = msgspec.msgpack.encode(Heartbeat(component="c", pid=1, time=2.0,
                                            progress={"steps": 3}, holds_work=False))
    assert msgspec.msgpack.decode(data)["kind"] == "heartbeat"
    assert isinstance(msgspec.msgpack.decode(data, type=ToSupervisor), Heartbeat)


def test_interval_must_be_positive(ctx, short_dir) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        HeartbeatSender(ctx, ipc_address(short_dir, "x"), "c", interval_s=0)
