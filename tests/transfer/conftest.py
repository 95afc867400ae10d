"""DistFlow test factories: run ids, pools in named segments, spawned peers."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import uuid
from typing import Iterator

import msgspec
import pytest
import torch

from deepserve.ipc.segments import attach_segment, create_segment, list_segments, segment_name, unlink_segment
from deepserve.transfer import PeerEndpoint
from tests.transfer.peer import serve_pool

SHAPE = (2, 3, 2, 16, 4, 8)  # (K/V, L, H, NB, bs, D)
JOIN_S = 10.0
SPAWN_WAIT_S = 60.0  # a spawned child imports torch: seconds on a busy machine


def _check_clean(prefix: str) -> None:
    leftovers = list_segments(prefix)
    for name in leftovers:
        unlink_segment(name)
    assert not leftovers, f"left shared-memory segments behind: {leftovers}"


@pytest.fixture(scope="module")
def run_id() -> Iterator[str]:
    """A run id for the module; no `deepserve-{run_id}*` segment may remain after it."""
    value = "t" + uuid.uuid4().hex[:9]
    yield value
    _check_clean(f"deepserve-{value}")


@contextlib.contextmanager
def pool_segment(name: str, shape=SHAPE, dtype=torch.float32) -> Iterator[torch.Tensor]:
    """A pool tensor in a fresh named segment, unlinked afterwards."""
    seg = create_segment(name, math.prod(shape) * dtype.itemsize)
    try:
        pool = torch.frombuffer(seg.buf, dtype=dtype).view(shape)
        yield pool
        del pool
    finally:
        try:
            seg.close()
        except BufferError:
            pass
        unlink_segment(name)


class Peer:
    """A spawned process that owns a pool segment and serves it (see peer.py)."""

    def __init__(self, name: str, shape=SHAPE, dtype: str = "float32"):
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_pool, args=(name, shape, dtype, child), daemon=True)
        self.proc.start()
        self.endpoint: PeerEndpoint | None = None

    def ready(self) -> PeerEndpoint:
        if self.endpoint is None:
            assert self.conn.poll(SPAWN_WAIT_S), "peer process did not come up"
            self.endpoint = msgspec.json.decode(self.conn.recv_bytes(), type=PeerEndpoint)
        return self.endpoint

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send_bytes(b"stop")
        self.proc.join(JOIN_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(JOIN_S)
        unlink_segment(self.name)  # a killed peer could not


@pytest.fixture(scope="module")
def peers(run_id) -> Iterator[dict[str, Peer]]:
    """Two peer processes, started together: "main" serves, "victim" gets killed."""
    started = {role: Peer(segment_name(run_id, f"{role}-kv")) for role in ("main", "victim")}
    try:
        for p in started.values():
            p.ready()
        yield started
    finally:
        for p in started.values():
            p.stop()


@pytest.fixture
def peer(peers) -> Peer:
    return peers["main"]


@contextlib.contextmanager
def attached_pool(endpoint: PeerEndpoint) -> Iterator[torch.Tensor]:
    """The peer's pool, mapped here to read what a transfer wrote."""
    seg = attach_segment(endpoint.shm)
    try:
        pool = torch.frombuffer(seg.buf, dtype=getattr(torch, endpoint.dtype),
                                count=math.prod(endpoint.shape)).view(endpoint.shape)
        yield pool
        del pool
    finally:
        seg.close()


@pytest.fixture(scope="module")
def src_pool(run_id) -> Iterator[torch.Tensor]:
    with pool_segment(segment_name(run_id, "src-kv")) as pool:
        pool.copy_(torch.randn(SHAPE))
        yield pool
