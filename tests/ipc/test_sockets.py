"""Typed ZeroMQ sockets: a tagged union round-trips; receives time out."""

from __future__ import annotations

import contextlib
import time

import msgspec
import pytest
import zmq

from deepserve.ipc.sockets import (PubSocket, PullSocket, PushSocket, SubSocket,
                                   endpoints, ipc_address)


class Ping(msgspec.Struct, tag=True, array_like=True):
    seq: int


class Submit(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    token_ids: list[int]
    temperature: float = 1.0


Command = Ping | Submit


def test_ipc_address_checks_the_path_length(short_dir):
    assert ipc_address(short_dir, "engine") == f"ipc://{short_dir}/engine.sock"
    with pytest.raises(ValueError):
        ipc_address("/tmp/" + "x" * 120, "engine")


def test_tagged_union_round_trips_over_push_pull(short_dir):
    ctx = zmq.Context.instance()
    address = ipc_address(short_dir, "cmd")
    pull = PullSocket(ctx, address, bind=True, type=Command)
    push = PushSocket(ctx, address, bind=False)
    try:
        sent = [Ping(1), Submit("r-1", [1, 2, 3]), Submit("r-2", [], temperature=0.5)]
        for msg in sent:
            push.put(msg, timeout=5.0)
        assert [pull.get(timeout=5.0) for _ in sent] == sent
        assert not pull.poll(0.0)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            pull.get(timeout=0.1)
        assert 0.09 <= time.monotonic() - started <= 1.0
    finally:
        push.close()
        pull.close()


def test_push_without_peer_times_out(short_dir):
    push = PushSocket(zmq.Context.instance(), ipc_address(short_dir, "lonely"), bind=True)
    try:
        with pytest.raises(TimeoutError):
            push.put(Ping(0), timeout=0.05)
    finally:
        push.close()


def test_pub_sub_delivers_once_subscribed(short_dir):
    ctx = zmq.Context.instance()
    address = ipc_address(short_dir, "events")
    pub = PubSocket(ctx, address)
    sub = SubSocket(ctx, address, bind=False, type=Command)
    try:
        # PUB drops until the subscription has arrived (slow joiner): retry.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            pub.put(Ping(7))
            if sub.poll(0.01):
                break
        assert sub.get(timeout=1.0) == Ping(7)
    finally:
        sub.close()
        pub.close()


def test_an_address_of_several_heads_binds_its_first_and_sends_to_the_one_that_is_there(
        short_dir):
    """Standby heads ("A,B": the same socket on each head host): a binder takes
    the first; a sender connects to all with ZMQ_IMMEDIATE, so nothing queues
    for a head nobody binds. While no head is there a put without a timeout
    neither blocks nor queues (counted in num_unsent); with a timeout it
    times out. When the peer moves from A to B, B gets what is sent once the
    PUSH has seen A go."""
    ctx = zmq.Context.instance()
    a, b = ipc_address(short_dir, "head-a"), ipc_address(short_dir, "head-b")
    heads = f"{a},{b}"
    assert endpoints(heads) == [a, b] and endpoints(a) == [a]
    push = PushSocket(ctx, heads, bind=False)
    assert push.to_heads and push.socket.getsockopt(zmq.IMMEDIATE) == 1
    try:
        started = time.monotonic()
        push.put(Ping(0))  # nobody anywhere: dropped at once, not queued
        assert push.num_unsent == 1 and time.monotonic() - started < 0.5
        with pytest.raises(TimeoutError):
            push.put(Ping(0), timeout=0.1)
        on_a = PullSocket(ctx, heads, bind=True, type=Command)  # the head: binds A
        assert on_a.socket.getsockopt(zmq.LAST_ENDPOINT).decode() == a
        push.put(Ping(1), timeout=3.0)  # waits for the connection to A
        assert on_a.get(2.0) == Ping(1)  # the dropped Ping(0) never arrives
        assert not on_a.poll(0.2)
        on_a.close()  # the head dies; the standby binds B
        on_b = PullSocket(ctx, b, bind=True, type=Command)
        deadline = time.monotonic() + 5  # what goes before the PUSH sees A gone is lost
        while not on_b.poll(0.05):  # with A (as a dead head's CM loses a report)
            assert time.monotonic() < deadline, "nothing reached the standby's socket"
            with contextlib.suppress(TimeoutError):
                push.put(Ping(2), timeout=0.1)
        assert on_b.get(1.0) == Ping(2)
        on_b.close()
    finally:
        push.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_frame_past_the_cap_disconnects_its_sender_and_the_receiver_lives(short_dir, transport):
    """ZMQ_MAXMSGSIZE on every receiver: a frame of max_bytes arrives, one byte
    more is never held (its peer is dropped), and the socket takes the next
    peer's frames. The default is MAX_FRAME_BYTES."""
    from deepserve.ipc.sockets import MAX_FRAME_BYTES, free_port
    cap = 1000
    addr = ipc_address(short_dir, "capped") if transport == "ipc" else \
        f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    pull = PullSocket(ctx, addr, bind=True, type=bytes, max_bytes=cap)
    default = PullSocket(ctx, ipc_address(short_dir, "default"), bind=True, type=bytes)
    try:
        assert pull.socket.getsockopt(zmq.MAXMSGSIZE) == cap
        assert default.socket.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES

        def frame(size: int) -> bytes:  # msgpack bin 16: 3 header bytes
            data = msgspec.msgpack.encode(b"x" * (size - 3))
            assert len(data) == size
            return data

        def send(data: bytes) -> None:
            push = ctx.socket(zmq.PUSH)
            push.linger = 1000
            push.connect(addr)
            push.send(data)
            push.close()
        send(frame(cap))  # at the cap
        assert pull.get(timeout=5.0) == b"x" * (cap - 3)
        send(frame(cap + 1))  # one past it: dropped with its sender
        assert not pull.poll(1.0)
        send(frame(300))  # the next peer is served
        assert pull.get(timeout=5.0) == b"x" * 297
    finally:
        pull.close()
        default.close()
        ctx.term()
