"""Typed ZeroMQ sockets: a tagged union round-trips; receives time out."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from deepserve.ipc.sockets import (PubSocket, PullSocket, PushSocket, SubSocket,
                                   ipc_address)


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
