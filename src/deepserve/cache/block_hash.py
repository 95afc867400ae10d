"""Stable hashes of full KV blocks, chained along a prompt.

    h(block i) = blake2b-64( h(block i-1) || token ids of block i ),  h(-1) = h(salt)

Equal hashes mean equal token prefixes (up to 2^-64) under the same salt, in
every process (Python's own hash() of str is salted per process, so it is not
used). The TE's radix tree stamps each node with its hash and reports inserts
and evictions; the job executor keeps a set of hashes per TE.

prompt_block_hashes is the job executor's hot path (every routed job): it
converts the ids to bytes once, slices memoryviews, keeps the running digest
as bytes and turns the digests into ints once at the end. Its values are
chain_hash's, block by block (tests/cache/test_block_hash.py).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Hashable, Sequence


_BLAKE2B_64 = hashlib.blake2b(digest_size=8)  # copied per block: cheaper than a new one


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def root_hash(salt: Hashable = None) -> int:
    return _digest(b"deepserve-root:" + repr(salt).encode())


def chain_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    return _digest(parent_hash.to_bytes(8, "little", signed=True) + array("q", token_ids).tobytes())


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: Hashable = None
                        ) -> list[int]:
    """Hashes of the prompt's full blocks, in order (chain_hash along the prompt)."""
    num_blocks = len(token_ids) // block_size
    if num_blocks <= 0:
        return []
    step = 8 * block_size  # bytes of one block's ids ("q": 8 bytes each, as chain_hash)
    data = memoryview(array("q", token_ids).tobytes())
    h = root_hash(salt).to_bytes(8, "little", signed=True)
    digests = bytearray()
    for start in range(0, num_blocks * step, step):
        hasher = _BLAKE2B_64.copy()
        hasher.update(h)
        hasher.update(data[start:start + step])
        h = hasher.digest()
        digests += h
    return list(struct.unpack(f"<{num_blocks}q", digests))
