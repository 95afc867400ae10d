"""Outboxes: a bogus address drops, a peer that does not read stalls once, then never blocks."""

from __future__ import annotations

import time

import zmq

from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import PullSocket, ipc_address


def test_refused_addresses_drop_and_never_raise() -> None:
    ctx = zmq.Context()
    out = Outboxes(ctx, timeout_s=0.2)
    try:
        for address in ["not an address", "tcp://", "bogus://x", "ipc://" + "x" * 5000, "\x00"]:
            assert out.put(address, {"a": 1}) is False
            assert out.is_stalled(address)
        assert out.num_dropped == 5
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
