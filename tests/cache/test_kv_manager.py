import pytest

from deepserve.cache.kv_manager import KVCacheManager

BS = 4


def _run_prefill(kv: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    assert kv.allocate(seq_id, tokens, len(tokens))
    kv.commit(seq_id, tokens, len(tokens))


def test_allocate_grow_free_exact_block_ids():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.allocate(0, list(range(6)), 6)
    assert kv.block_table(0) == [0, 1]
    assert kv.grow(0, 9)
    assert kv.block_table(0) == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.free(0)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_prefix_hit_shares_blocks_and_keeps_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    _run_prefill(kv, 0, tokens)
    assert kv.num_cached_tokens(tokens) == 4  # whole prompt cached, one block recomputed
    assert kv.num_cached_tokens(tokens + [99]) == 8
    assert kv.allocate(1, tokens + [99], 9)
    assert kv.block_table(1)[:2] == kv.block_table(0)
    kv.check_integrity()
    kv.free(0)
    kv.free(1)
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_equal_block_committed_twice_is_deduplicated():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    assert kv.allocate(0, tokens, 8) and kv.allocate(1, tokens, 8)
    kv.commit(0, tokens, 8)
    kv.commit(1, tokens, 8)
    assert kv.block_table(1) == kv.block_table(0) == [0, 1]
    assert kv.num_free_blocks == 6  # seq 1's own copies went back
    kv.check_integrity()


def test_allocation_evicts_cached_blocks_lru_and_fails_cleanly():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    _run_prefill(kv, 0, [1] * 8)
    kv.free(0)
    _run_prefill(kv, 1, [2] * 8)
    kv.free(1)
    assert kv.num_free_blocks == 4 and kv.tree.num_nodes == 4
    assert kv.allocate(2, [3] * 4, 4)
    assert kv.block_table(2) == [1]  # the least recently used leaf: [1]*8's second block
    assert not kv.allocate(3, [4] * 20, 20)  # needs 5 > 3 available: nothing changes
    assert not kv.has_seq(3)
    kv.check_integrity()


def test_matched_unreferenced_blocks_do_not_count_as_free():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    _run_prefill(kv, 0, list(range(8)))
    kv.free(0)
    # 1 free + 2 evictable; reusing both cached blocks leaves 1 for the rest.
    assert not kv.allocate(1, list(range(8)) + [50] * 8, 16)
    assert kv.allocate(1, list(range(8)) + [50] * 4, 12)
    assert kv.block_table(1) == [0, 1, 2]
    kv.check_integrity()


def test_prefix_caching_off_never_matches():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    _run_prefill(kv, 0, list(range(8)))
    assert kv.num_cached_tokens(list(range(9))) == 0
    assert kv.tree.num_nodes == 0
    kv.check_integrity()


def test_integrity_check_catches_a_leak():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv._free.popleft()
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_integrity()
