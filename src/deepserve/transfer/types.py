"""The public value types of DistFlow: regions, endpoints, results, the error.

A *region* names blocks of a KV pool. A pool is one contiguous tensor

    (2, L, H, NB, bs, D)    # K/V, layers, kv heads, blocks, block size, head dim

and a region is a list of block ids (in order) plus an optional layer range.
The source and destination regions of one transfer pair up block by block:
src.block_ids[j] goes to dst.block_ids[j], for both K and V, for every layer
of the range and every head.
"""

from __future__ import annotations

import msgspec


class TransferError(RuntimeError):
    """A transfer failed: peer gone, timeout, short write, checksum mismatch, bad region."""


class PoolRegion(msgspec.Struct, array_like=True, frozen=True):
    """Blocks of a pool, in transfer order, and a [start, stop) layer range."""

    block_ids: list[int]  # blocks of the pool, in order
    layers: tuple[int, int] | None = None  # [start, stop) layer range; None = all layers


class PeerEndpoint(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """How to reach a peer's pool. shm: its segment name (same node); tcp: its DistFlowReceiver address."""

    shape: tuple[int, ...]  # the peer pool's shape
    dtype: str  # e.g. "bfloat16", "float32"
    shm: str | None = None
    tcp: str | None = None


class TransferResult(msgspec.Struct):
    """What one finished transfer moved: bytes, wall seconds, checksum, backend."""

    nbytes: int
    seconds: float
    checksum: int | None = None  # crc32 of the bytes, in canonical order (see layout.py)
    backend: str = ""
