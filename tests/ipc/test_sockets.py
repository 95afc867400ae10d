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


def test_a_tcp_peer_that_goes_silent_without_a_reset_is_dropped_by_heartbeats():
    """A partition drops packets and sends no reset: a PUSH connected to every
    head would keep queueing to the silent one for the kernel's minutes. Here a
    relay stops forwarding (the fault: it counts what it swallows) and keeps
    both connections open; the PUSH drops the peer after HEARTBEAT_TIMEOUT_MS."""
    import socket
    import threading

    from zmq.utils.monitor import recv_monitor_message

    from deepserve.ipc.sockets import HEARTBEAT_TIMEOUT_MS, free_port
    ctx = zmq.Context()
    target = f"tcp://127.0.0.1:{free_port()}"
    pull = PullSocket(ctx, target, bind=True, type=Command)
    relay = socket.socket()
    relay.bind(("127.0.0.1", 0))
    relay.listen(1)
    frozen, swallowed, stop = threading.Event(), [0], threading.Event()

    def pump(src, dst) -> None:
        src.settimeout(0.1)
        while not stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if frozen.is_set():
                swallowed[0] += len(data)
            else:
                dst.sendall(data)

    def serve() -> None:
        conn, _ = relay.accept()
        upstream = socket.create_connection(("127.0.0.1", int(target.rsplit(":", 1)[1])))
        threading.Thread(target=pump, args=(upstream, conn), daemon=True).start()
        pump(conn, upstream)
        conn.close()
        upstream.close()
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    push = PushSocket(ctx, f"tcp://127.0.0.1:{relay.getsockname()[1]}", bind=False)
    events = push.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        push.put(Ping(seq=1))
        assert pull.get(timeout=5) == Ping(seq=1)  # through the relay
        frozen.set()  # the fault
        disconnected = events.poll(HEARTBEAT_TIMEOUT_MS + 3000)
        assert swallowed[0] > 0  # heartbeats went into the void
        assert disconnected and recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        stop.set()
        push.socket.disable_monitor()
        events.close(linger=0)
        push.close()
        pull.close()
        relay.close()
        server.join(5)
        ctx.term()
