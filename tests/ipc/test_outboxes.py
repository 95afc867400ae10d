"""Outboxes: a bogus address drops, a peer that does not read stalls once, then never blocks."""

from __future__ import annotations

import threading
import time

import zmq

from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import PullSocket, ipc_address


def test_refused_addresses_drop_and_never_raise() -> None:
    ctx = zmq.Context()
    out = Outboxes(ctx, timeout_s=0.2)
    try:
        lists = ["tcp://127.0.0.1:1,tcp://127.0.0.1:2", ","]  # no peer to wait a timeout for
        for address in ["not an address", "tcp://", "bogus://x", "ipc://" + "x" * 5000, "\x00",
                        *lists]:
            started = time.monotonic()
            assert out.put(address, {"a": 1}) is False
            assert out.is_stalled(address) and time.monotonic() - started < 0.1
        assert out.num_dropped == 7 and len(out) == 0
        heads = Outboxes(ctx, timeout_s=0.2, lists=(lists[0],))  # its own config's: a socket
        try:
            heads.put(lists[0], {"a": 1})
            assert len(heads) == 1
        finally:
            heads.close()
    finally:
        out.close()
        ctx.term()


def test_a_peer_that_stops_reading_costs_one_timeout_then_recovers(short_dir) -> None:
    ctx = zmq.Context()
    address = ipc_address(short_dir, "peer")
    pull = PullSocket(ctx, address, bind=True, type=dict)
    pull.socket.setsockopt(zmq.RCVHWM, 1)
    out = Outboxes(ctx, timeout_s=0.3)
    out._socket(address).socket.setsockopt(zmq.SNDHWM, 1)
    try:
        sent = 0
        start = time.monotonic()
        while out.put(address, {"i": sent}):  # fills both queues, then times out once
            sent += 1
            assert sent < 10_000
        first = time.monotonic() - start
        assert first >= 0.3 and out.is_stalled(address)
        start = time.monotonic()
        for _ in range(100):
            assert out.put(address, {"i": -1}) is False
        assert time.monotonic() - start < 0.2  # stalled: no waiting per message
        assert [pull.get(timeout=2.0)["i"] for _ in range(sent)] == list(range(sent))
        assert out.put(address, {"i": "again"}) is True  # reading again: not stalled
        assert not out.is_stalled(address)
        assert pull.get(timeout=2.0) == {"i": "again"}
    finally:
        out.close()
        pull.close()
        ctx.term()


def test_a_probe_waits_even_to_a_stalled_address_once_a_while(short_dir) -> None:
    """Under load, a gateway restarted on the same address had its first
    request aborted by the TE: the PUSH still held the dead gateway's backlog
    and a put that did not wait found the queue full. A request's first reply
    is a probe: it waits (PROBE_WAIT_S, once per PROBE_EVERY_S per address),
    and goes through once the peer reads."""
    from deepserve.ipc.outboxes import PROBE_EVERY_S, PROBE_WAIT_S
    ctx = zmq.Context()
    address = ipc_address(short_dir, "peer")
    pull = PullSocket(ctx, address, bind=True, type=dict)
    pull.socket.setsockopt(zmq.RCVHWM, 1)
    now = [0.0]
    out = Outboxes(ctx, timeout_s=1.0, clock=lambda: now[0])
    out._socket(address).socket.setsockopt(zmq.SNDHWM, 1)
    try:
        while out.put(address, {"i": 0}):  # fill both queues: one timeout, then stalled
            pass
        start = time.monotonic()
        assert out.put(address, {"i": 1}) is False and time.monotonic() - start < 0.1
        start = time.monotonic()
        assert out.put(address, {"i": 2}, probe=True) is False  # the peer reads nothing
        assert PROBE_WAIT_S <= time.monotonic() - start < 0.9 and out.is_stalled(address)
        start = time.monotonic()  # a second probe within PROBE_EVERY_S: no wait
        assert out.put(address, {"i": 2}, probe=True) is False
        assert time.monotonic() - start < 0.1
        now[0] += PROBE_EVERY_S
        got = []

        def read_until_3():
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and {"i": 3} not in got:
                try:
                    got.append(pull.get(timeout=0.1))
                except TimeoutError:
                    pass

        reader = threading.Thread(target=read_until_3)
        reader.start()  # the peer reads again while the probe waits: it goes through
        assert out.put(address, {"i": 3}, probe=True) is True and not out.is_stalled(address)
        reader.join(6.0)
        assert got[-1] == {"i": 3}
    finally:
        out.close()
        pull.close()
        ctx.term()


def test_a_socket_not_put_to_for_idle_s_is_closed_and_reopens_on_the_next_put(short_dir) -> None:
    """Peers come and go (a scaled TE, a pod): the tier service kept a socket,
    one fd, per master it ever answered. Idle ones close; one in use stays."""
    ctx = zmq.Context()
    now = [0.0]
    out = Outboxes(ctx, timeout_s=0.2, clock=lambda: now[0], idle_s=100.0)
    pulls = {n: PullSocket(ctx, ipc_address(short_dir, n), bind=True, type=dict)
             for n in ("gone0", "gone1", "busy")}
    try:
        for name, pull in pulls.items():
            assert out.put(ipc_address(short_dir, name), {"to": name})
            assert pull.get(timeout=2.0) == {"to": name}
        assert len(out) == 3
        now[0] = 60.0
        assert out.put(ipc_address(short_dir, "busy"), {"to": "busy"})
        assert len(out) == 3  # nothing idle for 100 s yet
        now[0] = 130.0
        assert out.put(ipc_address(short_dir, "busy"), {"to": "busy"})
        assert len(out) == 1  # the two idle since 0 s closed; busy (60 s) kept
        assert out.put(ipc_address(short_dir, "gone0"), {"to": "gone0", "again": True})
        assert len(out) == 2
        assert pulls["gone0"].get(timeout=2.0) == {"to": "gone0", "again": True}
        assert [pulls["busy"].get(timeout=2.0) for _ in range(2)] == [{"to": "busy"}] * 2
    finally:
        out.close()
        for pull in pulls.values():
            pull.close()
        ctx.term()


def test_at_most_max_sockets_are_open_the_least_recently_used_closes(short_dir) -> None:
    """reply_to comes from messages: requests naming addresses of their own
    held a socket (an fd) apiece for IDLE_S. At the cap nothing closes; one
    past it closes the socket put to least recently, and it reopens on use."""
    ctx = zmq.Context()
    now = [0.0]
    out = Outboxes(ctx, timeout_s=0.2, clock=lambda: now[0], max_sockets=3)
    names = ("a", "b", "c", "d")
    pulls = {n: PullSocket(ctx, ipc_address(short_dir, n), bind=True, type=dict) for n in names}
    try:
        for n in ("a", "b", "c"):
            now[0] += 1
            assert out.put(ipc_address(short_dir, n), {"to": n})
        now[0] += 1
        assert out.put(ipc_address(short_dir, "a"), {"to": "a"})  # a is the newest now
        assert len(out) == 3 and out.num_evicted == 0  # at the cap
        now[0] += 1
        assert out.put(ipc_address(short_dir, "d"), {"to": "d"})  # one past it
        assert len(out) == 3 and out.num_evicted == 1
        assert ipc_address(short_dir, "b") not in out._sockets  # the least recent went
        now[0] += 1
        assert out.put(ipc_address(short_dir, "b"), {"to": "b", "again": True})
        assert out.num_evicted == 2 and ipc_address(short_dir, "c") not in out._sockets
        assert [pulls["a"].get(timeout=2.0) for _ in range(2)] == [{"to": "a"}] * 2
        assert pulls["d"].get(timeout=2.0) == {"to": "d"}
        got = pulls["b"].get(timeout=2.0)  # its first may have gone with its socket (linger 0)
        got = got if got.get("again") else pulls["b"].get(timeout=2.0)
        assert got == {"to": "b", "again": True}
    finally:
        out.close()
        for pull in pulls.values():
            pull.close()
        ctx.term()
