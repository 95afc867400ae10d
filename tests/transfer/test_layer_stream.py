"""LayerStream (transfer/layer_stream.py): a real server thread and real
DEALER clients on loopback; every refusal is an error the puller sees."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import zmq

from deepserve.ipc.sockets import LOCAL
from deepserve.transfer.layer_stream import LayerStreamClient, LayerStreamServer
from deepserve.transfer.types import TransferError

N, L, H, BS, D = 3, 4, 2, 4, 8


def blocks(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(N * 2 * L * H * BS * D).view(N, 2, L, H, BS, D) + seed).to(dtype)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture(params=["local", "tcp"])
def server(ctx, request):
    """What a TE binds on one host (LOCAL: ipc://, a 0700 directory of its own,
    removed on close), and tcp as across hosts."""
    bind = LOCAL if request.param == "local" else "tcp://127.0.0.1:0"
    s = LayerStreamServer(bind, ctx, max_bytes=4 * blocks().numel() * 4)
    directory = Path(s.address[len("ipc://"):]).parent if bind == LOCAL else None
    if directory is not None:
        assert s.address.startswith("ipc://") and directory.stat().st_mode & 0o777 == 0o700
    yield s
    s.close()
    assert directory is None or not directory.exists()


@pytest.fixture
def client(ctx, server):
    c = LayerStreamClient(server.address, ctx, timeout_s=2.0)
    yield c
    c.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pulled_layer_is_that_layer_of_the_rows_asked_in_their_order(server, client, dtype):
    src = blocks(7, dtype)
    server.put(5, src)
    for layer in range(L):
        got = client.pull(5, layer, [2, 0])
        assert got.dtype == dtype and got.shape == (2, 2, H, BS, D)
        assert torch.equal(got[0], src[2, :, layer]) and torch.equal(got[1], src[0, :, layer])
    assert server.num_pulls == L
    assert server.bytes_served == L * 2 * 2 * H * BS * D * src.element_size()


def test_unknown_streams_rows_and_layers_are_errors_and_the_server_goes_on(server, client):
    server.put(1, blocks())
    for stream_id, layer, rows, why in [(2, 0, [0], "no stream 2"), (1, L, [0], "layer"),
                                        (1, -1, [0], "layer"), (1, 0, [N], "row"),
                                        (1, 0, [-1], "row"), (1, 0, [0] * (N + 1), "rows")]:
        with pytest.raises(TransferError, match=why):
            client.pull(stream_id, layer, rows)
    assert torch.equal(client.pull(1, L - 1, [N - 1])[0], blocks()[N - 1, :, L - 1])


def test_a_dropped_stream_is_gone(server, client):
    server.put(1, blocks())
    assert server.drop(1) and not server.drop(1)
    with pytest.raises(TransferError, match="no stream 1"):
        client.pull(1, 0, [0])
    assert server.held_bytes == 0


def test_the_buffer_holds_max_bytes_and_refuses_past_them(server):
    one = blocks().numel() * 4
    assert server.room(one // N) == 4 * N  # blocks of one third: 12 fit
    for sid in range(4):
        server.put(sid, blocks())  # exactly max_bytes
    assert server.held_bytes == server.max_bytes and server.room(1) == 0
    with pytest.raises(ValueError, match="over the buffer"):
        server.put(9, blocks()[:1])
    server.put(3, blocks()[:1])  # replacing a stream frees its own bytes first
    assert server.held_bytes == 3 * one + one // N


def test_a_stream_nobody_pulls_expires_and_a_pulled_one_does_not(ctx):
    server = LayerStreamServer("tcp://127.0.0.1:0", ctx, ttl_s=0.6)
    client = LayerStreamClient(server.address, ctx, timeout_s=2.0)
    try:
        server.put(1, blocks())
        server.put(2, blocks())
        for _ in range(4):  # 0.8 s: stream 1 is kept alive by its pulls
            client.pull(1, 0, [0])
            time.sleep(0.2)
        client.pull(1, 0, [0])
        with pytest.raises(TransferError, match="no stream 2"):
            client.pull(2, 0, [0])
    finally:
        client.close()
        server.close()


def test_a_server_that_is_gone_is_a_bounded_error(ctx):
    server = LayerStreamServer("tcp://127.0.0.1:0", ctx)
    server.put(1, blocks())
    address = server.address
    server.close()
    client = LayerStreamClient(address, ctx, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        client.pull(1, 0, [0])
    assert time.monotonic() - t0 < 2.0
    client.close()


def test_a_wildcard_bind_is_refused(ctx):
    with pytest.raises(ValueError, match="wildcard"):
        LayerStreamServer("tcp://0.0.0.0:0", ctx)


def test_garbage_on_the_socket_is_dropped_and_the_server_goes_on(ctx, server, client):
    server.put(1, blocks())
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    raw.send_multipart([b"\x00garbage", b"more"])
    raw.send(b"\xff\xfe")
    raw.close()
    assert torch.equal(client.pull(1, 2, [1])[0], blocks()[1, :, 2])
