"""DistFlow test factories: run ids, pools in named segments, spawned peers."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import random
import uuid
from typing import Iterator

import msgspec
import pytest
import torch

from deepserve.ipc.segments import attach_segment, create_segment, list_segments, segment_name, unlink_segment
from deepserve.transfer import PeerEndpoint, PoolRegion, TransferError, TransferResult
from tests.cluster.netns import HostNet
from tests.transfer.peer import serve_pool
from tests.transfer.sender import Link, Reply, Send

SHAPE = (2, 3, 2, 16, 4, 8)  # (K/V, L, H, NB, bs, D)
NB = SHAPE[3]
JOIN_S = 10.0
SPAWN_WAIT_S = 60.0  # a spawned child imports torch: seconds on a busy machine
SENDER_WAIT_S = 30.0
PATTERNS = ("consecutive", "scattered", "layers")


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
        self.endpoint: PeerEndpoint | None = None
        self.conn, self.proc = self._start(shape, dtype)

    def _start(self, shape, dtype: str):
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=serve_pool, args=(self.name, shape, dtype, child), daemon=True)
        proc.start()
        return conn, proc

    def ready(self) -> PeerEndpoint:
        if self.endpoint is None:
            assert self.conn.poll(SPAWN_WAIT_S), "peer process did not come up"
            self.endpoint = msgspec.json.decode(self.conn.recv_bytes(), type=PeerEndpoint)
        return self.endpoint

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send_bytes(b"stop")
        self._reap()
        unlink_segment(self.name)  # a killed peer could not

    def _reap(self) -> None:
        self.proc.join(JOIN_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(JOIN_S)


class HostPeer(Peer):
    """A Peer inside host `host` of a HostNet, its receiver bound to that host's address."""

    def __init__(self, hosts: HostNet, host: int, name: str, shape=SHAPE, dtype: str = "float32"):
        self.hosts, self.host = hosts, host
        super().__init__(name, shape, dtype)

    def _start(self, shape, dtype: str):
        bind = f"tcp://{self.hosts.addresses[self.host]}:0"
        return self.hosts.python_piped(self.host, "tests.transfer.peer", self.name,
                                       msgspec.json.encode(shape).decode(), dtype, bind)

    def _reap(self) -> None:
        HostNet.reap(self.proc, JOIN_S)


class HostSender:
    """DistFlow over our source pool, run inside host `host` (see sender.py); raises like it."""

    def __init__(self, hosts: HostNet, host: int, segment: str, timeout_s: float):
        self.conn, self.proc = hosts.python_piped(host, "tests.transfer.sender", segment,
                                                  msgspec.json.encode(SHAPE).decode(),
                                                  "float32", str(timeout_s))

    def link(self, peer_id: str, endpoint: PeerEndpoint, backend: str) -> str:
        return self._ask(Link(peer_id, endpoint, backend), SPAWN_WAIT_S).backend

    def transfer(self, peer_id: str, src: PoolRegion, dst: PoolRegion) -> TransferResult:
        return self._ask(Send(peer_id, src, dst), SENDER_WAIT_S).result

    def _ask(self, order, wait_s: float) -> Reply:
        self.conn.send_bytes(msgspec.msgpack.encode(order))
        assert self.conn.poll(wait_s), "the sender process did not answer"
        reply = msgspec.msgpack.decode(self.conn.recv_bytes(), type=Reply)
        if reply.error:
            raise TransferError(reply.error)
        return reply

    def stop(self) -> None:
        self.conn.close()  # EOF: the sender closes its DistFlow and exits
        HostNet.reap(self.proc, JOIN_S)


@contextlib.contextmanager
def serving(started: dict) -> Iterator[dict]:
    """Peers started together (their torch imports overlap): ready for the block, stopped after."""
    try:
        for p in started.values():
            p.ready()
        yield started
    finally:
        for p in started.values():
            p.stop()


@pytest.fixture(scope="module")
def peers(run_id) -> Iterator[dict[str, Peer]]:
    """Two peer processes: "main" serves, "victim" gets killed."""
    with serving({role: Peer(segment_name(run_id, f"{role}-kv"))
                  for role in ("main", "victim")}) as started:
        yield started


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


def block_pattern(pattern: str, seed: str) -> tuple[list[int], list[int], tuple[int, int] | None]:
    """(src ids, dst ids, layers) of a test transfer: one run, scattered, or scattered + layers."""
    if pattern == "consecutive":
        return list(range(2, 9)), list(range(5, 12)), None
    rng = random.Random(seed)
    src, dst = rng.sample(range(NB), 9), rng.sample(range(NB), 9)
    return src, dst, (1, 3) if pattern == "layers" else None


def assert_landed(dst_pool: torch.Tensor, src_pool: torch.Tensor, src: list[int], dst: list[int],
                  layers: tuple[int, int] | None) -> None:
    """The dst blocks equal the src blocks exactly over the layers; every other byte is still 0."""
    l0, l1 = layers or (0, SHAPE[1])
    assert torch.equal(dst_pool[:, l0:l1, :, dst], src_pool[:, l0:l1, :, src])
    untouched = torch.ones(NB, dtype=torch.bool)
    untouched[dst] = False
    assert not dst_pool[:, :, :, untouched].any()
    assert not dst_pool[:, :l0].any() and not dst_pool[:, l1:].any()


def region_nbytes(num_blocks: int, layers: tuple[int, int] | None) -> int:
    """Bytes a float32 transfer of num_blocks blocks over `layers` moves."""
    l0, l1 = layers or (0, SHAPE[1])
    return 2 * (l1 - l0) * SHAPE[2] * num_blocks * SHAPE[4] * SHAPE[5] * 4
