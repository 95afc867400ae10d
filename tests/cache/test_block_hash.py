"""cache/block_hash.py: the fast prompt_block_hashes gives chain_hash's values."""

import random

import pytest

from deepserve.cache.block_hash import chain_hash, prompt_block_hashes, root_hash


def chained(token_ids, block_size, salt=None) -> list[int]:
    """The formula, one block at a time (the module doc)."""
    hashes, h = [], root_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = chain_hash(h, token_ids[start:start + block_size])
        hashes.append(h)
    return hashes


@pytest.mark.parametrize("seed", range(8))
def test_prompt_block_hashes_equal_the_chained_formula(seed):
    rng = random.Random(seed)
    for _ in range(40):
        block_size = rng.choice([1, 2, 3, 16, 32, 64])
        n = rng.randrange(0, 12 * block_size + block_size)  # partial last blocks too
        top = rng.choice([2, 1000, 152_064, 1 << 40])
        ids = [rng.randrange(-top if seed % 2 else 0, top) for _ in range(n)]
        salt = rng.choice([None, "tenant-a", "", 7, ("t", 1)])
        assert prompt_block_hashes(ids, block_size, salt) == chained(ids, block_size, salt)


def test_short_prompts_and_pinned_values():
    assert prompt_block_hashes([1, 2, 3], 16) == []
    assert prompt_block_hashes([], 1) == []
    ids = list(range(32))
    assert prompt_block_hashes(ids, 16) == [chain_hash(root_hash(), ids[:16]),
                                            chain_hash(chain_hash(root_hash(), ids[:16]),
                                                       ids[16:])]
    assert prompt_block_hashes(ids, 16, "a") != prompt_block_hashes(ids, 16, "b")
    # the values TEs and the JE have always computed (before the fast path)
    assert prompt_block_hashes(ids, 16) == [612384511186666012, 4833826992914887429]
    assert prompt_block_hashes(list(range(40)), 8, "t")[-1] == 2968476006542781649
