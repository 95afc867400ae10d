"""The master's tier policy (engine/tiers/) with exact blocks: no processes."""

import itertools

import pytest

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.sequence import Sequence
from deepserve.engine.tiers.coordinator import TierCoordinator
from deepserve.messages.cache import (DROP_LAYERS, LOAD_DISK, LOAD_HOST, LOAD_LAYERS, NO_SLOT,
                                      ON_DISK, STAGE_DISK,
                                      STORE_HOST, BlockGeometry, CacheOpsDone, ContextPin,
                                      TierCommit, TierCommitted, TierDrop, TierHits, TierLookup,
                                      TierRelease, TierReserve, TierReserved)
from deepserve.messages.sampling import SamplingParams
from deepserve.tiers.cost_model import CostModel

BS = 4
GEOM = BlockGeometry(1, 1, BS, 2, "float32")


def coordinator(tp: int) -> tuple[KVCacheManager, TierCoordinator]:
    kv = KVCacheManager(32, BS, collect_new_nodes=True)
    ids = itertools.count(1000)
    return kv, TierCoordinator(kv, model_key="m", geometry=GEOM, address="ipc://me",
                               cost=CostModel(block_bytes=64, block_size=BS, enabled=False),
                               tp=tp, new_seq_id=lambda: next(ids))


@pytest.fixture
def env():
    kv, tiers = coordinator(tp=2)
    yield kv, tiers
    kv.check_integrity()


def seq(n=17, seq_id=1, salt="t"):
    return Sequence(seq_id, list(range(100, 100 + n)), SamplingParams(), frozenset(), salt)


def done(op, num_ok=None, rank=0, **kw):
    n = len(op.block_ids) if num_ok is None else num_ok
    return CacheOpsDone(rank=rank, op_id=op.op_id, num_ok=n, **kw)


def test_a_miss_below_is_looked_up_and_hits_come_up_through_a_holder(env):
    kv, tiers = env
    s = seq()  # 17 tokens: 4 full blocks are cacheable
    effects = tiers.admit(s, 0.0)
    [lookup] = effects.sends
    assert isinstance(lookup, TierLookup)
    assert lookup.hashes == prompt_block_hashes(s.token_ids, BS, "t")[:4]
    hits = TierHits(lookup_id=lookup.lookup_id, lease_id=7, slots=[5, 6, ON_DISK, 9],
                    segment="seg", disk_dir="/d")
    effects = tiers.on_hits(hits, 0.1)
    ops = effects.ops
    assert [(o.kind, len(o.block_ids)) for o in ops] == [(LOAD_HOST, 2), (LOAD_DISK, 1),
                                                         (LOAD_HOST, 1)]
    assert ops[0].slots == [5, 6] and ops[1].hashes == [lookup.hashes[2]] and not effects.ready
    for op in ops:  # rank 0 of every op, then rank 1: only then is it done
        assert not tiers.on_ops_done(done(op), 0.2).ready
    effects = [tiers.on_ops_done(done(op, rank=1), 0.3) for op in ops][-1]
    assert effects.ready == [s] and s.holder_seq_id is not None
    assert TierRelease(lease_id=7, model_key="m") in effects.sends
    assert kv.num_cached_tokens(s.token_ids, "t") == 16
    assert s.tier_tokens == {"host": 12, "disk": 4}


def test_a_load_that_stops_commits_only_the_blocks_before_the_stop(env):
    kv, tiers = env
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    ops = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=3,
                                 slots=[ON_DISK] * 4, disk_dir="/d"), 0.0).ops
    [op] = ops
    tiers.on_ops_done(done(op), 0.1)
    effects = tiers.on_ops_done(done(op, num_ok=1, rank=1, corrupt=[op.hashes[1]],
                                     error="corrupt"), 0.2)
    assert kv.num_cached_tokens(s.token_ids, "t") == 4
    assert TierDrop(model_key="m", hashes=[op.hashes[1]]) in effects.sends
    assert effects.events[0][0] == "cache_block_corrupt"
    assert len(kv.block_table(s.holder_seq_id)) == 1  # the unfilled blocks went back


def test_a_request_that_ends_while_its_blocks_come_up_frees_its_holder(env):
    kv, tiers = env
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    [op] = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=3, slots=[1, 2],
                                  segment="seg"), 0.0).ops
    s.status = type(s.status).FINISHED  # aborted meanwhile
    tiers.on_ops_done(done(op), 0.1)
    effects = tiers.on_ops_done(done(op, rank=1), 0.1)
    assert not effects.ready and kv.num_free_blocks == 32


def test_no_answer_is_a_miss_and_late_hits_are_released(env):
    kv, tiers = env
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    assert tiers.poll(5.0).ready == [s]
    late = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=9, slots=[1]), 6.0)
    assert late.sends == [TierRelease(lease_id=9, model_key="m")] and not late.ready


def _fill(kv, keep_free: int) -> int:
    """A running sequence takes all but keep_free blocks; its seq id."""
    assert kv.allocate(99, list(range(900, 900 + BS * (32 - keep_free))), BS * (32 - keep_free))
    return 99


def test_hits_with_no_room_wait_holding_nothing_then_look_again(env):
    kv, tiers = env
    hog = _fill(kv, keep_free=2)  # 2 free blocks: the 4 hits do not fit
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    effects = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=7,
                                     slots=[ON_DISK] * 4, disk_dir="/d"), 0.1)
    # not computed (that would need the blocks and the compute), lease let go
    assert not effects.ready and not effects.ops
    assert TierRelease(lease_id=7, model_key="m") in effects.sends
    assert tiers.lookups_by_outcome["no_room"] == 1 and tiers.has_work
    assert not tiers.poll(0.2).sends  # still no room: no new lookup
    kv.free(hog)
    again = tiers.poll(0.3).sends
    assert [type(m) for m in again] == [TierLookup] and again[0].hashes == lookup.hashes
    ops = tiers.on_hits(TierHits(lookup_id=again[0].lookup_id, lease_id=8,
                                 slots=[ON_DISK] * 4, disk_dir="/d"), 0.4).ops
    assert tiers.lookups_by_outcome["fetch"] == 1 and len(ops[0].block_ids) == 4
    for op in ops:
        tiers.on_ops_done(done(op), 0.5)
    assert tiers.on_ops_done(done(ops[0], rank=1), 0.5).ready == [s]
    kv.free(s.holder_seq_id)


def test_a_request_waiting_for_room_counts_its_disk_hits_in_the_read_queue_once(env):
    kv, tiers = env  # the queue DualPath's scheduler weighs (TEReport.storage_queue_tokens)
    hog = _fill(kv, keep_free=2)
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=7, slots=[5, ON_DISK, ON_DISK],
                           segment="seg", disk_dir="/d"), 0.1)
    assert tiers.waiting and tiers.storage.num_blocks == 0  # nothing dispatched yet ...
    assert tiers.read_queue_blocks == 2  # ... but two blocks to read once it has room
    kv.free(hog)
    again = tiers.poll(0.2).sends[0]
    assert tiers.read_queue_blocks == 0  # looking again: what it reads is not known yet
    ops = tiers.on_hits(TierHits(lookup_id=again.lookup_id, lease_id=8,
                                 slots=[5, ON_DISK, ON_DISK, ON_DISK], segment="seg",
                                 disk_dir="/d"), 0.3).ops
    assert not tiers.waiting and tiers.read_queue_blocks == tiers.storage.num_blocks == 3
    for rank in (0, 1):
        for op in ops:
            tiers.on_ops_done(done(op, rank=rank), 0.4)
    assert tiers.read_queue_blocks == 0
    kv.free(s.holder_seq_id)


def test_waiting_for_room_ends_at_the_deadline_in_a_recompute(env):
    kv, tiers = env
    hog = _fill(kv, keep_free=2)
    s, other = seq(), seq(seq_id=2, salt="u")
    for r, lease in ((s, 7), (other, 8)):
        lookup = tiers.admit(r, 0.0).sends[0]
        tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=lease,
                               slots=[ON_DISK] * 4, disk_dir="/d"), 0.0)
    other.status = type(other.status).FINISHED  # aborted while waiting: dropped quietly
    deadline = tiers.channel.op_timeout_s
    assert not tiers.poll(deadline - 0.1).ready
    effects = tiers.poll(deadline + 0.1)
    assert effects.ready == [s] and not effects.sends
    assert tiers.lookups_by_outcome["room_timeout"] == 1 and not tiers.has_work
    kv.free(hog)


def test_hits_larger_than_the_whole_pool_do_not_wait():
    kv = KVCacheManager(3, BS, collect_new_nodes=True)
    tiers = TierCoordinator(kv, model_key="m", geometry=GEOM, address="ipc://me",
                            cost=CostModel(block_bytes=64, block_size=BS, enabled=False), tp=1,
                            new_seq_id=iter(range(1000, 2000)).__next__)
    s = seq()  # 4 cacheable blocks: more than the pool has
    lookup = tiers.admit(s, 0.0).sends[0]
    effects = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=7,
                                     slots=[ON_DISK] * 4, disk_dir="/d"), 0.1)
    assert effects.ready == [s] and not tiers.waiting  # computed now, as before
    assert tiers.lookups_by_outcome["no_room"] == 1


def test_room_is_counted_once_for_the_requests_it_lets_look_again(env):
    kv, tiers = env
    hog = _fill(kv, keep_free=2)
    waiting = [seq(seq_id=i, salt=f"s{i}") for i in (1, 2, 3)]
    for r in waiting:
        lookup = tiers.admit(r, 0.0).sends[0]
        tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=r.seq_id,
                               slots=[ON_DISK] * 4, disk_dir="/d"), 0.0)
    kv.free(hog)
    assert kv.allocate(98, list(range(800, 800 + BS * 23)), BS * 23)  # 9 free
    # 4 blocks each: two fit in 9 (each counted once), the third waits
    assert len(tiers.poll(0.1).sends) == 2 and len(tiers.waiting) == 1
    kv.free(98)


def test_new_tree_blocks_are_written_through_and_pinned_until_copied(env):
    kv, tiers = env
    s = seq(9)
    kv.allocate(s.seq_id, s.token_ids, 9, "t")
    kv.commit(s.seq_id, s.token_ids, 9)  # 2 full blocks enter the tree
    effects = tiers.write_through(0.0)
    [reserve] = effects.sends
    assert isinstance(reserve, TierReserve) and len(reserve.hashes) == 2
    store = next(iter(tiers.writes.stores.values()))
    kv.check_integrity(store.pinned)
    kv.free(s.seq_id)
    assert kv.num_free_blocks == 32 - 2  # pinned: not evictable while being copied
    [op] = tiers.on_reserved(TierReserved(reserve_id=reserve.reserve_id, lease_id=4,
                                          slots=[NO_SLOT, 8], segment="seg"), 0.1).ops
    assert op.kind == STORE_HOST and op.slots == [8] and len(op.block_ids) == 1
    tiers.on_ops_done(done(op), 0.2)
    effects = tiers.on_ops_done(done(op, rank=1), 0.2)
    assert effects.sends == [TierCommit(lease_id=4, model_key="m", slots=[8], reserve_id=
                                        reserve.reserve_id)]
    assert kv.num_free_blocks == 32 and not tiers.has_work


def test_a_context_is_pinned_whole_and_ends_only_once_committed(env):
    kv, tiers = env
    s = seq(9)
    s.pin_context = ContextPin("ctx-1", 99.0)
    kv.allocate(s.seq_id, s.token_ids, 9, "t")
    kv.commit(s.seq_id, s.token_ids, 9)
    kv.pop_new_nodes()
    [reserve] = tiers.write_through(0.0, context=s, nodes=kv.nodes_of(s.seq_id)).sends
    assert (reserve.context_id, reserve.expires_at, len(reserve.hashes)) == ("ctx-1", 99.0, 2)
    effects = tiers.on_reserved(TierReserved(reserve_id=reserve.reserve_id, lease_id=0,
                                             slots=[NO_SLOT, NO_SLOT]), 0.1)
    [commit] = effects.sends
    assert commit.reply_to == "ipc://me" and not effects.ended
    effects = tiers.on_committed(TierCommitted(reserve_id=reserve.reserve_id), 0.2)
    assert effects.ended == [s]
    kv.free(s.seq_id)


def test_a_context_over_budget_fails_with_its_code(env):
    kv, tiers = env
    s = seq(9)
    s.pin_context = ContextPin("ctx-2", 99.0)
    kv.allocate(s.seq_id, s.token_ids, 9, "t")
    kv.commit(s.seq_id, s.token_ids, 9)
    [reserve] = tiers.write_through(0.0, context=s, nodes=kv.nodes_of(s.seq_id)).sends
    effects = tiers.on_reserved(TierReserved(reserve_id=reserve.reserve_id,
                                             error="over_budget"), 0.1)
    assert effects.failed[0][:2] == (s, "context_over_budget")
    kv.free(s.seq_id)


def test_a_decode_task_stages_its_disk_blocks_up_then_orders_the_prefill(env):
    kv, tiers = env
    s = seq()  # 4 cacheable blocks, all looked up: the prefill TE needs them, not this one
    effects = tiers.stage(s, 0.0)
    [lookup] = effects.sends
    assert lookup.hashes == prompt_block_hashes(s.token_ids, BS, "t")[:4] and not effects.staged
    [reserve] = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=5,
                                       slots=[3, ON_DISK, ON_DISK], disk_dir="/d"), 0.1).sends
    assert isinstance(reserve, TierReserve) and reserve.hashes == lookup.hashes[1:3]
    assert reserve.hold  # slots only for what the tier can hold for the prefill TE
    [op] = tiers.on_reserved(TierReserved(reserve_id=reserve.reserve_id, lease_id=6,
                                          slots=[7, NO_SLOT], segment="seg"), 0.2).ops
    assert (op.kind, op.block_ids, op.slots, op.hashes, op.disk_dir) == (
        STAGE_DISK, [], [7], [lookup.hashes[1]], "/d")
    assert tiers.storage.num_blocks == 1
    assert not tiers.on_ops_done(CacheOpsDone(rank=1, op_id=op.op_id, num_ok=0), 0.3)
    effects = tiers.on_ops_done(CacheOpsDone(rank=0, op_id=op.op_id, num_ok=1, nbytes=64), 0.3)
    assert effects.staged == [s]
    # committed and held: the staged slot and the lookup's host block stay
    # pinned for the prefill TE until the task's KV arrives
    assert effects.sends == [TierCommit(lease_id=6, model_key="m", slots=[7], hold=True)]
    assert tiers.storage.num_blocks == 0 and not tiers.has_work
    assert tiers.storage.bytes_read == {"prefill": 0, "decode": 64}
    assert kv.num_free_blocks == 32  # staging takes no device blocks
    assert tiers.unstage(s.seq_id).sends == [TierRelease(lease_id=5, model_key="m"),
                                             TierRelease(lease_id=6, model_key="m")]
    assert not tiers.unstage(s.seq_id).sends  # once


def _staging_of_four_disk_blocks(tiers, s):
    """s staged: its 4 blocks on disk (lookup lease 5), reserved in slots
    1-4 (lease 6); the stage op the workers get."""
    lookup = tiers.stage(s, 0.0).sends[0]
    [reserve] = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=5,
                                       slots=[ON_DISK] * 4, disk_dir="/d"), 0.0).sends
    [op] = tiers.on_reserved(TierReserved(reserve_id=reserve.reserve_id, lease_id=6,
                                          slots=[1, 2, 3, 4], segment="seg"), 0.0).ops
    return op


def test_a_stage_whose_copy_never_ends_orders_the_prefill_and_commits_nothing(env):
    kv, tiers = env
    s = seq()
    op = _staging_of_four_disk_blocks(tiers, s)
    assert tiers.storage.num_blocks == 4 and not tiers.poll(10.0).staged
    effects = tiers.poll(10.1)  # op_timeout_s (10) past
    assert effects.staged == [s] and not effects.sends  # the lookup's lease is held
    assert tiers.storage.num_blocks == 0 and not tiers.has_work
    assert tiers.unstage(s.seq_id).sends == [TierRelease(lease_id=5, model_key="m")]


def test_a_task_that_ends_while_staging_holds_nothing(env):
    kv, tiers = env
    s = seq()
    op = _staging_of_four_disk_blocks(tiers, s)
    s.status = type(s.status).FINISHED  # aborted meanwhile
    tiers.on_ops_done(CacheOpsDone(rank=1, op_id=op.op_id, num_ok=0), 0.1)
    effects = tiers.on_ops_done(CacheOpsDone(rank=0, op_id=op.op_id, num_ok=4, nbytes=256), 0.1)
    assert not effects.staged
    assert effects.sends == [TierCommit(lease_id=6, model_key="m", slots=[1, 2, 3, 4]),
                             TierRelease(lease_id=5, model_key="m")]
    assert not tiers.staging.held


# -- layer-wise loads (engine/tiers/layered.py): the request's own blocks ------------------
@pytest.fixture
def layered():
    kv, tiers = coordinator(tp=1)  # a layered load needs tp 1
    tiers.layered.layers = 2
    yield kv, tiers
    kv.check_integrity()


def disk_load(tiers, s, lease_id=3):
    """A request whose 4 cacheable blocks are all on disk: its load_layers op."""
    lookup = tiers.admit(s, 0.0).sends[0]
    [op] = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=lease_id,
                                  slots=[ON_DISK] * 4, disk_dir="/d"), 0.0).ops
    return op


def test_a_disk_hit_loads_layer_by_layer_into_the_requests_own_blocks(layered):
    kv, tiers = layered
    s = seq()  # 17 tokens: 5 blocks, 4 of them cacheable
    lookup = tiers.admit(s, 0.0).sends[0]
    effects = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=7,
                                     slots=[5, ON_DISK, ON_DISK, 9], segment="seg",
                                     disk_dir="/d"), 0.1)
    [op] = effects.ops
    assert op.kind == LOAD_LAYERS and op.seq_id == s.seq_id and op.layers == 2
    assert op.block_ids == kv.block_table(s.seq_id)[:4]  # its own, not a holder's
    assert len(kv.block_table(s.seq_id)) == 5  # the whole prompt: nothing to grow later
    assert op.slots == [5, ON_DISK, ON_DISK, 9] and op.hashes[0] == op.hashes[3] == 0
    assert op.hashes[1:3] == lookup.hashes[1:3] and not effects.ready
    assert kv.num_cached_tokens(s.token_ids, "t") == 0  # never in the tree half-loaded
    assert tiers.lookups_by_outcome["fetch_layers"] == 1 and tiers.storage.num_blocks == 2
    effects = tiers.on_ops_done(done(op, nbytes=2 * 64), 0.3)  # its first layers are read
    assert effects.ready == [s] and s.preloaded_tokens == 16 and s.holder_seq_id is None
    assert TierRelease(lease_id=7, model_key="m") in effects.sends
    assert s.tier_tokens == {"disk": 8, "host": 8} and tiers.storage.num_blocks == 0
    assert not tiers.has_work


def test_a_layered_load_cut_short_or_empty_at_its_prime(layered):
    kv, tiers = layered
    s = seq()
    op = disk_load(tiers, s)
    effects = tiers.on_ops_done(done(op, num_ok=1, nbytes=64, corrupt=[op.hashes[1]]), 0.1)
    assert effects.ready == [s] and s.preloaded_tokens == 4  # the rest it computes
    assert TierDrop(model_key="m", hashes=[op.hashes[1]]) in effects.sends
    t = seq(seq_id=2, salt="u")
    op = disk_load(tiers, t, lease_id=4)
    effects = tiers.on_ops_done(done(op, num_ok=0, error="gone"), 0.1)
    [drop] = effects.ops
    assert drop.kind == DROP_LAYERS and drop.seq_id == 2 and t.preloaded_tokens == 0


def test_a_layered_load_never_primed_is_dropped_and_computed(layered):
    kv, tiers = layered
    s = seq()
    disk_load(tiers, s)
    assert not tiers.poll(5.0).ready  # within op_timeout_s
    effects = tiers.poll(11.0)
    [drop] = effects.ops
    assert drop.kind == DROP_LAYERS and effects.ready == [s] and s.preloaded_tokens == 0
    assert TierRelease(lease_id=3, model_key="m") in effects.sends and not tiers.has_work
    late = tiers.on_ops_done(CacheOpsDone(rank=0, op_id=drop.op_id - 1, num_ok=4), 12.0)
    assert not late.ready  # a late prime of the dropped load changes nothing


def test_a_request_aborted_while_priming_frees_its_blocks_once(layered):
    kv, tiers = layered
    s = seq()
    op = disk_load(tiers, s)
    kv.free(s.seq_id)  # what Scheduler.finish does for it
    s.status = type(s.status).FINISHED
    effects = tiers.on_ops_done(done(op, nbytes=4 * 64), 0.1)
    assert not effects.ready and kv.num_free_blocks == 32


def test_a_load_lost_in_the_forward_is_counted_and_its_files_dropped(layered):
    kv, tiers = layered
    effects = tiers.lost_layers([11, 12])
    assert TierDrop(model_key="m", hashes=[11, 12]) in effects.sends
    assert [e[0] for e in effects.events] == ["cache_block_corrupt"] * 2
    assert tiers.lookups_by_outcome["layers_lost"] == 1


def test_no_room_for_a_layered_load_waits_for_the_whole_prompt(layered):
    kv, tiers = layered
    hog = seq(n=4 * 29, seq_id=9, salt="x")
    assert kv.allocate(9, hog.token_ids, 4 * 29, "x")  # 3 blocks left of 32
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    effects = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=3,
                                     slots=[ON_DISK] * 4, disk_dir="/d"), 0.0)
    assert not effects.ops and tiers.waiting[0].num_blocks == 5  # all of its 5, not 4
    kv.free(9)
