"""DistFlow tcp between hosts: byte-identical blocks from host A's address to host B's.

    host 0 (A) 10.213.77.1         host 1 (B) 10.213.77.2       host 2 (C) 10.213.77.3
    sender.py: DistFlow over  ---> peer.py: DistFlowReceiver    peer.py: the victim,
    the test's src segment   tcp   bound to tcp://B:0, pool     killed by its pid
                                   in its own segment

The test process stays in the root namespace: it owns the source pool's
segment and maps the peers' segments to compare bytes (/dev/shm is shared by
all namespaces, which is also why every link here forces tcp and hands the
sender an endpoint with no shm name). That the bytes crossed the bridge is
checked, not assumed: the receiver's address is B's, B holds an established
connection from A's address to it, and A's eth0 sent at least the payload.
"""

from __future__ import annotations

import signal
import time

import pytest

from deepserve.ipc.segments import segment_name
from deepserve.transfer import PeerEndpoint, PoolRegion, TransferError
from deepserve.transfer.layout import checksum_region
from tests.transfer.conftest import (PATTERNS, SHAPE, HostPeer, HostSender, assert_landed,
                                     attached_pool, block_pattern, region_nbytes, serving)

pytestmark = pytest.mark.slow  # three processes that import torch
A, B, C = 0, 1, 2
TIMEOUT_S = 2.0  # the sender's DistFlow timeout: a dead peer must fail within it


def _tcp_only(endpoint: PeerEndpoint) -> PeerEndpoint:
    return PeerEndpoint(shape=endpoint.shape, dtype=endpoint.dtype, tcp=endpoint.tcp)


@pytest.fixture(scope="module")
def host_peers(hosts, run_id):
    """B serves the pool the tests write; C serves a victim that gets killed."""
    with serving({B: HostPeer(hosts, B, segment_name(run_id, "b-kv")),
                  C: HostPeer(hosts, C, segment_name(run_id, "c-kv"))}) as started:
        yield started


@pytest.fixture(scope="module")
def sender(hosts, run_id, src_pool, host_peers):
    """DistFlow in host A over src_pool, linked over tcp to B ("b") and C ("c")."""
    s = HostSender(hosts, A, segment_name(run_id, "src-kv"), TIMEOUT_S)
    try:
        for peer_id, host in (("b", B), ("c", C)):
            assert s.link(peer_id, _tcp_only(host_peers[host].endpoint), "tcp") == "tcp"
        yield s
    finally:
        s.stop()


def test_receiver_binds_its_hosts_address(hosts, host_peers):
    for host, peer in host_peers.items():
        assert peer.endpoint.tcp.startswith(f"tcp://{hosts.addresses[host]}:")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_transfer_between_hosts_is_byte_identical(hosts, host_peers, sender, src_pool, pattern):
    peer = host_peers[B]
    src, dst, layers = block_pattern(pattern, f"hosts{pattern}")
    tx_before = hosts.eth_bytes(A)[1]
    with attached_pool(peer.endpoint) as dst_pool:
        dst_pool.zero_()
        result = sender.transfer("b", PoolRegion(src, layers), PoolRegion(dst, layers))
        assert_landed(dst_pool, src_pool, src, dst, layers)
    assert result.backend == "tcp"
    assert result.nbytes == region_nbytes(len(src), layers)
    assert result.checksum == checksum_region(src_pool, src, layers or (0, SHAPE[1]))
    assert hosts.eth_bytes(A)[1] - tx_before >= result.nbytes  # it left A on the wire
    receiver = peer.endpoint.tcp.removeprefix("tcp://")
    assert any(local == receiver and remote.startswith(f"{hosts.addresses[A]}:")
               for local, remote in hosts.connections(B))


def test_dead_peer_is_an_error_within_the_timeout(host_peers, sender):
    victim = host_peers[C]
    sender.transfer("c", PoolRegion([0, 1]), PoolRegion([0, 1]))
    victim.proc.kill()  # by its pid: ip exec'd the peer itself
    assert victim.proc.wait(10) == -signal.SIGKILL  # the fault happened: the peer is gone
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        sender.transfer("c", PoolRegion([0, 1]), PoolRegion([0, 1]))
    assert time.monotonic() - t0 < TIMEOUT_S + 3.0
