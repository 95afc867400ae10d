"""Stable hashes of full KV blocks, chained along a prompt.

    h(block i) = blake2b-64( h(block i-1) || token ids of block i ),  h(-1) = h(salt)

Equal hashes mean equal token prefixes (up to 2^-64) under the same salt, in
every process (Python's own hash() of str is salted per process, so it is not
used). The TE's radix tree stamps each node with its hash and reports inserts
and evictions; the job executor keeps a set of hashes per TE.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Sequence


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def root_hash(salt: Hashable = None) -> int:
    return _digest(b"deepserve-root:" + repr(salt).encode())


def chain_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    return _digest(parent_hash.to_bytes(8, "little", signed=True) + array("q", token_ids).tobytes())


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: Hashable = None
                        ) -> list[int]:
    """Hashes of the prompt's full blocks, in order."""
    hashes, h = [], root_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = chain_hash(h, token_ids[start:start + block_size])
        hashes.append(h)
    return hashes
