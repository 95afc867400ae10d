"""ShmLink: same node, the destination pool mapped into this process.

The peer's pool segment is attached once at link time and viewed as a tensor;
a transfer is then `layout.copy_blocks` straight from our pool into theirs:
one strided torch copy per run of consecutive ids, no staging, no messages,
no receiver thread. Nothing tells the peer a transfer happened: the caller
signals completion on its own channel once the handle is done.

With a checksum, the sender reads the destination bytes back after the copy
and compares them with the source bytes (both in canonical order).
"""

from __future__ import annotations

import math

import torch

from deepserve.ipc.segments import attach_segment
from deepserve.transfer import layout
from deepserve.transfer.types import PeerEndpoint, TransferError


class ShmLink:
    backend = "shm"

    def __init__(self, pool: torch.Tensor, endpoint: PeerEndpoint):
        if not endpoint.shm:
            raise TransferError("shm backend needs endpoint.shm")
        try:
            self._segment = attach_segment(endpoint.shm)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot attach peer segment {endpoint.shm!r}: {e}") from e
        dtype = layout.to_dtype(endpoint.dtype)
        numel = math.prod(endpoint.shape)
        if self._segment.size < numel * dtype.itemsize:
            self._segment.close()
            raise TransferError(f"segment {endpoint.shm!r} has {self._segment.size} bytes, "
                                f"a {endpoint.shape} {endpoint.dtype} pool needs "
                                f"{numel * dtype.itemsize}")
        self.pool = pool
        self.peer_pool = torch.frombuffer(self._segment.buf, dtype=dtype,
                                          count=numel).view(endpoint.shape)
        self.peer_shape = tuple(endpoint.shape)

    def run(self, tid: int, src_ids: list[int], dst_ids: list[int], layers: tuple[int, int],
            want_checksum: bool) -> int | None:
        peer = self.peer_pool
        if peer is None:
            raise TransferError("link closed")
        layout.copy_blocks(self.pool, src_ids, peer, dst_ids, layers)
        if not want_checksum:
            return None
        crc = layout.checksum_region(self.pool, src_ids, layers)
        if layout.checksum_region(peer, dst_ids, layers) != crc:
            raise TransferError("checksum mismatch: destination bytes differ from source")
        return crc

    def close(self) -> None:
        """Drop our view; the mapping goes when the last in-flight copy lets go of it."""
        self.peer_pool = None
        try:
            self._segment.close()
        except BufferError:  # a transfer still holds the view; GC unmaps later
            pass
