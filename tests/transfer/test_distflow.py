"""DistFlow between processes: byte-identical blocks over shm, tcp and ring.

The destination pool lives in a spawned peer process (its own segment,
served by a DistFlowReceiver); the sender's pool is in a segment of this
process. After each transfer the test maps the peer's segment and compares
the blocks exactly, besides the checksum the receiving side acknowledged.
"""

from __future__ import annotations

import time

import pytest
import torch

from deepserve.transfer import DistFlow, PeerEndpoint, PoolRegion, TransferError
from deepserve.transfer.layout import checksum_region
from tests.transfer.conftest import (NB, PATTERNS, SHAPE, assert_landed, attached_pool,
                                     block_pattern, region_nbytes)

BACKENDS = ("shm", "tcp", "ring")
RING_BYTES = 1024  # 4 rows of 128 bytes per slot: many chunks per transfer


def _endpoint(peer, backend: str) -> PeerEndpoint:
    ep = peer.endpoint
    return PeerEndpoint(shape=ep.shape, dtype=ep.dtype, shm=ep.shm,
                        tcp=None if backend == "shm" else ep.tcp)


@pytest.fixture
def flow(src_pool):
    df = DistFlow(src_pool, num_threads=2, timeout_s=5.0, ring_bytes=RING_BYTES)
    yield df
    df.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_transfer_is_byte_identical(flow, src_pool, peer, backend, pattern):
    assert flow.link("p", _endpoint(peer, backend), backend) == backend
    src, dst, layers = block_pattern(pattern, f"{backend}{pattern}")
    with attached_pool(peer.endpoint) as dst_pool:
        dst_pool.zero_()
        result = flow.transfer("p", PoolRegion(src, layers), PoolRegion(dst, layers),
                               checksum=True).wait(10)
        assert_landed(dst_pool, src_pool, src, dst, layers)
    assert result.backend == backend
    assert result.nbytes == region_nbytes(len(src), layers)
    assert result.checksum == checksum_region(src_pool, src, layers or (0, SHAPE[1]))


def test_auto_prefers_shm_then_tcp(flow, peer):
    assert flow.link("p", peer.endpoint) == "shm"
    gone = PeerEndpoint(shape=SHAPE, dtype="float32", shm="deepserve-nosuch-kv",
                        tcp=peer.endpoint.tcp)
    assert flow.link("p", gone) == "tcp"
    flow.transfer("p", PoolRegion([0]), PoolRegion([0]), checksum=True).wait(10)


def test_region_mismatch_raises_at_once(flow, peer):
    flow.link("p", peer.endpoint, "tcp")
    bad = [
        (PoolRegion([1, 2]), PoolRegion([1])),  # counts differ
        (PoolRegion([1], (0, 2)), PoolRegion([1], (1, 3))),  # layer ranges differ
        (PoolRegion([1], (0, 2)), PoolRegion([1])),
        (PoolRegion([1], (2, 9)), PoolRegion([1], (2, 9))),  # past the layers
        (PoolRegion([NB]), PoolRegion([0])),  # source id out of range
        (PoolRegion([0]), PoolRegion([-1])),  # destination id out of range
        (PoolRegion([0, 1]), PoolRegion([3, 3])),  # destination id repeated
    ]
    for src, dst in bad:
        with pytest.raises(TransferError):
            flow.transfer("p", src, dst)
    with pytest.raises(TransferError, match="no link"):
        flow.transfer("nobody", PoolRegion([0]), PoolRegion([0]))


def test_link_failures(flow, peer):
    missing = PeerEndpoint(shape=SHAPE, dtype="float32", shm="deepserve-nosuch-kv")
    for backend in ("auto", "shm"):
        with pytest.raises(TransferError, match="cannot attach"):
            flow.link("p", missing, backend)
    other = PeerEndpoint(shape=(2, 3, 2, 16, 4, 16), dtype="float32", shm=peer.endpoint.shm)
    with pytest.raises(TransferError, match="does not match"):
        flow.link("p", other)
    with pytest.raises(TransferError, match="does not match"):
        flow.link("p", PeerEndpoint(shape=SHAPE, dtype="bfloat16", shm=peer.endpoint.shm))
    larger = PeerEndpoint(shape=(2, 3, 2, 99, 4, 8), dtype="float32", tcp=peer.endpoint.tcp)
    with pytest.raises(TransferError, match="receiver at"):  # NB differs from the real pool
        flow.link("p", larger, "tcp")


def test_dead_peer_is_an_error_within_the_timeout(src_pool, peers):
    victim = peers["victim"]
    df = DistFlow(src_pool, timeout_s=1.0)
    try:
        assert df.link("v", victim.endpoint, "tcp") == "tcp"
        df.transfer("v", PoolRegion([0, 1]), PoolRegion([0, 1])).wait(5)
        victim.proc.kill()
        victim.proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            df.transfer("v", PoolRegion([0, 1]), PoolRegion([0, 1])).wait(5)
        assert time.monotonic() - t0 < 3.0
    finally:
        df.close()
