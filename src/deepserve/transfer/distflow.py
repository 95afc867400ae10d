"""DistFlow: point-to-point KV block transfers from this process's pool.

    df = DistFlow(pool)                        # our (2, L, H, NB, bs, D) pool
    df.link("te1", endpoint)                   # LinkCluster: pick a backend, check shapes
    h = df.transfer("te1", PoolRegion([3, 4, 5]), PoolRegion([10, 11, 12]))
    h.wait()                                   # TransferResult, or TransferError

Backends (one link per peer):
  shm   same node, the peer's pool segment mapped here; copy straight across
  ring  same node, not mapped; through a staging segment + a DistFlowReceiver
  tcp   any node; ZeroMQ frames to a DistFlowReceiver
"auto" takes shm when endpoint.shm names a segment we can attach, else tcp.

Errors: `transfer` checks the request itself and raises TransferError at once
(unknown peer, block counts or layer ranges differ, a block id outside
either pool, a destination id repeated). Everything that happens later (peer
gone, timeout, short write, checksum mismatch) is raised by the handle's
`wait`. Every wait inside a backend is bounded by `timeout_s`.

Transfers run on `num_threads` daemon threads; transfers over one tcp or
ring link run one at a time, shm transfers in parallel. Exception: an shm
transfer of at most INLINE_MAX_BYTES without checksum runs in the caller
and returns a handle that is already done, because such a copy (tens of
microseconds) is cheaper than the hop to a worker thread and back.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch
import zmq

from deepserve.transfer import layout
from deepserve.transfer.handle import TransferHandle, Workers
from deepserve.transfer.net_link import RingLink, TcpLink
from deepserve.transfer.shm_link import ShmLink
from deepserve.transfer.types import PeerEndpoint, PoolRegion, TransferError, TransferResult

BACKENDS = ("auto", "shm", "ring", "tcp")
DEFAULT_RING_BYTES = 16 << 20  # ring staging: two slots of 8 MiB
INLINE_MAX_BYTES = 2 << 20  # shm copies up to this size run in the caller


class DistFlow:
    """Links to peers' pools and asynchronous block transfers into them."""

    def __init__(self, pool: torch.Tensor, *, num_threads: int = 1, timeout_s: float = 30.0,
                 ctx: zmq.Context | None = None, ring_bytes: int = DEFAULT_RING_BYTES):
        layout.check_pool(pool)
        self.pool = pool
        self.timeout_s = timeout_s
        self.ring_bytes = ring_bytes
        self._ctx = ctx or zmq.Context.instance()
        self._dtype = layout.dtype_name(pool.dtype)
        self._links: dict[str, ShmLink | TcpLink] = {}
        self._lock = threading.Lock()  # guards _links
        self._tids = itertools.count(1)
        self._workers = Workers(num_threads)

    def link(self, peer_id: str, endpoint: PeerEndpoint, backend: str = "auto") -> str:
        """Connect to a peer's pool (replacing any old link); the backend chosen."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        layout.check_compatible(tuple(self.pool.shape), self._dtype, tuple(endpoint.shape),
                                endpoint.dtype)
        self.unlink(peer_id)
        new = self._open(endpoint, backend)
        with self._lock:
            self._links[peer_id] = new
        return new.backend

    def _open(self, endpoint: PeerEndpoint, backend: str) -> ShmLink | TcpLink:
        if backend == "auto":
            if endpoint.shm:
                try:
                    return ShmLink(self.pool, endpoint)
                except TransferError:
                    if not endpoint.tcp:
                        raise
            if not endpoint.tcp:
                raise TransferError("endpoint has neither shm nor tcp")
            backend = "tcp"
        if backend == "shm":
            return ShmLink(self.pool, endpoint)
        if backend == "ring":
            return RingLink(self.pool, endpoint, self._ctx, self.timeout_s, self.ring_bytes)
        return TcpLink(self.pool, endpoint, self._ctx, self.timeout_s)

    def unlink(self, peer_id: str) -> None:
        """Drop a link (waits, bounded, for a tcp/ring transfer on it). Unknown is fine."""
        with self._lock:
            old = self._links.pop(peer_id, None)
        if old is not None:
            old.close()

    def transfer(self, peer_id: str, src: PoolRegion, dst: PoolRegion, *,
                 checksum: bool = False) -> TransferHandle:
        """Copy our src blocks into the peer's dst blocks, asynchronously.

        Raises TransferError at once for a bad request; later failures come
        from the handle's `wait`.
        """
        with self._lock:
            link = self._links.get(peer_id)
        if link is None:
            raise TransferError(f"no link to peer {peer_id!r}")
        layers = layout.check_pair(src, dst, tuple(self.pool.shape), link.peer_shape)
        nbytes = layout.region_nbytes(tuple(self.pool.shape), self.pool.element_size(),
                                      len(src.block_ids), layers)
        tid = next(self._tids)

        def job() -> TransferResult:
            t0 = time.perf_counter()
            crc = None
            if nbytes:
                crc = link.run(tid, src.block_ids, dst.block_ids, layers, checksum)
            elif checksum:
                crc = 0  # crc32 of no bytes
            return TransferResult(nbytes, time.perf_counter() - t0, crc, link.backend)

        if link.backend == "shm" and not checksum and nbytes <= INLINE_MAX_BYTES:
            return self._workers.run_inline(job)
        return self._workers.submit(job)

    def close(self) -> None:
        """Cancel queued transfers, stop the threads, close every link."""
        self._workers.close(self.timeout_s)
        with self._lock:
            peers = list(self._links)
        for peer_id in peers:
            self.unlink(peer_id)
