"""The scheduler as a pure object: no model, a fake step that emits token 7."""

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.scheduler import LIGHT_TENANT_WINDOW_S, Scheduler
from deepserve.engine.sequence import Sequence, SequenceStatus
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import SampledToken

BS = 4


def _scheduler(num_blocks=64, budget=16, max_seqs=8, max_len=64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), budget, max_seqs, max_len)


def _seq(seq_id: int, num_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, [seq_id * 100 + i for i in range(num_prompt)],
                    SamplingParams(temperature=0, max_tokens=max_tokens), frozenset())


def _step(s: Scheduler) -> dict[int, int]:
    out = s.schedule()
    sampled = [SampledToken(i, 7) for i, n in out.scheduled.items()
               if out.seqs[i].num_computed_tokens + n == out.seqs[i].num_tokens]
    s.update(out, sampled)
    s.kv.check_integrity()
    return dict(out.scheduled)


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    s = _scheduler(budget=8)
    seq = _seq(1, 20)
    s.add(seq)
    assert _step(s) == {1: 8} and seq.num_output_tokens == 0
    assert _step(s) == {1: 8} and seq.num_output_tokens == 0
    assert _step(s) == {1: 4} and seq.num_output_tokens == 1
    assert _step(s) == {1: 1} and seq.num_output_tokens == 2


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget():
    s = _scheduler(budget=10)
    a, b = _seq(1, 3), _seq(2, 3)
    s.add(a)
    s.add(b)
    assert _step(s) == {1: 3, 2: 3}
    c = _seq(3, 30)
    s.add(c)
    assert _step(s) == {1: 1, 2: 1, 3: 8}
    # c is now a running prefill; decodes still come first
    assert list(_step(s)) == [1, 2, 3]


def test_admission_is_limited_by_free_blocks_and_max_num_seqs():
    s = _scheduler(num_blocks=4, budget=64)
    s.add(_seq(1, 12))
    s.add(_seq(2, 12))
    assert _step(s) == {1: 12}  # 3 blocks used; seq 2 needs 3, only 1 free
    assert [q.seq_id for q in s.waiting] == [2]
    s2 = _scheduler(max_seqs=1)
    s2.add(_seq(1, 2))
    s2.add(_seq(2, 2))
    assert _step(s2) == {1: 2}


def test_latest_arrived_is_preempted_and_recomputed():
    s = _scheduler(num_blocks=4, budget=64, max_len=64)
    a, b = _seq(1, 7, max_tokens=6), _seq(2, 4, max_tokens=6)
    s.add(a)
    s.add(b)
    assert _step(s) == {1: 7, 2: 4}  # a: 2 blocks, b: 1 block (+1 free)
    _step(s)  # a fills its block 2, b takes the last free block
    assert _step(s) == {1: 1}  # a needs a 3rd block: b (latest) is preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert s.num_preemptions == 1 and s.waiting[0] is b
    while s.has_unfinished:
        _step(s)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert s.kv.num_free_blocks == 4


def test_finish_frees_blocks_of_running_and_waiting():
    s = _scheduler()
    a, b = _seq(1, 5), _seq(2, 5)
    s.add(a)
    _step(s)
    s.add(b)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert not s.has_unfinished and a.finish_reason == "abort"
    assert s.kv.num_free_blocks == 64
    s.kv.check_integrity()


def test_max_tokens_and_stop_token_finish():
    s = _scheduler()
    a = _seq(1, 3, max_tokens=2)
    b = Sequence(2, [1, 2, 3], SamplingParams(max_tokens=10), frozenset({7}))
    s.add(a)
    s.add(b)
    _step(s)
    assert b.finish_reason == "stop" and b.output_token_ids == [7]
    _step(s)
    assert a.finish_reason == "length" and a.output_token_ids == [7, 7]


def test_a_holder_behind_the_head_of_the_queue_never_blocks_it():
    """A request whose prefix a lower tier filled waits with a holder (engine/
    tiers.py); the request ahead of it needs those blocks: the holder goes."""
    s = _scheduler(num_blocks=8, budget=64, max_len=64)
    head, behind = _seq(0, 24), _seq(1, 24)  # 6 blocks each (block size 4)
    holder = 99
    assert s.kv.allocate(holder, behind.token_ids, 20)  # 5 of the 8 blocks, filled "from host"
    s.kv.commit(holder, behind.token_ids, 20)
    behind.holder_seq_id = holder
    s.add(head)
    s.add(behind)
    assert _step(s) == {0: 24}  # before: the head waited for the holder's blocks forever
    assert behind.holder_seq_id is None and not s.kv.has_seq(holder)
    s.kv.check_integrity()


def test_a_request_that_ends_at_its_first_token_still_caches_its_prompt():
    s = _scheduler(budget=64)
    seq = _seq(0, 10, max_tokens=1)  # 2 full blocks of 4, and 2 more tokens
    s.add(seq)
    _step(s)
    assert seq.is_finished and seq.finish_reason == "length"
    assert s.kv.num_cached_tokens(seq.token_ids[:10] + [1]) == 8  # before: 0, nothing kept


def _tenant(seq: Sequence, tenant: str | None) -> Sequence:
    seq.tenant = tenant
    return seq


def test_a_light_tenant_gets_a_step_of_its_own():
    s = _scheduler(budget=16)
    a1, a2 = _tenant(_seq(1, 3, max_tokens=8), "A"), _tenant(_seq(2, 3, max_tokens=8), "A")
    s.add(a1)
    s.add(a2)
    assert _step(s) == {1: 3, 2: 3}
    a3 = _tenant(_seq(3, 5, max_tokens=8), "A")  # A's own next request: shares the step
    s.add(a3)
    assert _step(s) == {1: 1, 2: 1, 3: 5}
    b = _tenant(_seq(4, 6), "B")  # B has nothing running: its prefill runs alone
    s.add(b)
    assert _step(s) == {4: 6}
    assert b.num_output_tokens == 1 and a1.num_output_tokens == 2  # A waited one step
    b2 = _tenant(_seq(5, 2), "B")  # B is running now: not light, an ordinary step
    s.add(b2)
    assert _step(s) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2}


def test_without_tenants_nobody_is_light():
    s = _scheduler(budget=16)
    s.add(_seq(1, 3, max_tokens=8))
    assert _step(s) == {1: 3}
    s.add(_seq(2, 3))  # tenant None, as the running one: shares the step
    assert _step(s) == {1: 1, 2: 3}


def test_a_recent_tenant_with_nothing_running_may_come_light_and_ages_out():
    now = [0.0]
    s = Scheduler(KVCacheManager(64, BS), 16, 8, 64, clock=lambda: now[0])
    s.add(_tenant(_seq(1, 3, max_tokens=8), "A"))
    _step(s)
    assert not s.may_see_light_tenant()  # one tenant: the deep pipeline
    b = _tenant(_seq(2, 3, max_tokens=8), "B")
    s.add(b)
    _step(s)
    assert b.status is SequenceStatus.RUNNING and not s.may_see_light_tenant()  # both running: nobody is light
    s.finish(b, "abort")
    assert s.may_see_light_tenant()  # B has nothing running, A has
    now[0] = LIGHT_TENANT_WINDOW_S + 0.5  # B's last request is too old to count
    assert not s.may_see_light_tenant()


def test_while_a_light_tenant_may_come_the_others_steps_take_light_step_tokens():
    """The step a light request waits for is kept short: A's prefill goes in
    light_step_tokens chunks while B (seen lately) has nothing running, in
    full budget chunks once B runs or ages out, and with the knob at 0."""
    now = [0.0]
    s = Scheduler(KVCacheManager(64, BS), 16, 8, 64, clock=lambda: now[0], light_step_tokens=6)
    a = _tenant(_seq(1, 40, max_tokens=8), "A")
    s.add(a)
    assert _step(s) == {1: 16}  # one tenant: nobody may come light
    b = _tenant(_seq(2, 2, max_tokens=1), "B")
    s.add(b)
    assert _step(s) == {2: 2}  # B's own step (light), finished at once
    assert b.is_finished and s.may_see_light_tenant()
    assert _step(s) == {1: 6}  # A's chunk: the short step B's next request would wait for
    now[0] = LIGHT_TENANT_WINDOW_S + 0.5  # B's last request ages out
    assert _step(s) == {1: 16}
    off = Scheduler(KVCacheManager(64, BS), 16, 8, 64, clock=lambda: now[0])
    off.add(_tenant(_seq(3, 40, max_tokens=8), "A"))
    off.add(_tenant(_seq(4, 2, max_tokens=1), "B"))
    assert _step(off) == {3: 14, 4: 2}  # together: the step shared by the two tenants
    assert off.may_see_light_tenant() and _step(off) == {3: 16}  # 0: the full budget


def test_a_light_tenant_that_cannot_get_blocks_does_not_stop_the_others():
    s = _scheduler(num_blocks=4, budget=16)  # 16 tokens of KV in all
    a = _tenant(_seq(1, 8, max_tokens=8), "A")
    s.add(a)
    assert _step(s) == {1: 8}
    b = _tenant(_seq(2, 12), "B")  # needs 3 blocks, 1 is free
    s.add(b)
    assert _step(s) == {1: 1}  # A decodes; B waits for blocks
    assert b.status is SequenceStatus.WAITING


def test_a_preloaded_sequence_starts_past_its_loaded_blocks_in_its_own_blocks():
    """A layered load (engine/tiers/layered.py) gave it blocks for its whole
    prompt and fills its first 2: admitted without a new allocation, it
    computes only the rest, and its blocks are cached once that step is done."""
    s = _scheduler(budget=16)
    seq = _seq(1, 13)
    assert s.kv.allocate(1, seq.token_ids, 13)
    table = list(s.kv.block_table(1))
    seq.preloaded_tokens = 8
    s.add(seq)
    free = s.kv.num_free_blocks
    out = s.schedule()
    assert out.scheduled == {1: 5} and seq.num_computed_tokens == 8
    assert s.kv.block_table(1) == table and s.kv.num_free_blocks == free
    assert seq.preloaded_tokens is None and seq.num_cached_tokens == 8
    s.update(out, [SampledToken(1, 7)])
    assert s.kv.num_cached_tokens(seq.token_ids[:13] + [0], None) == 12
    s.finish(seq, "abort")
    s.kv.check_integrity()
    assert s.kv.num_free_blocks == 64  # freed: 3 blocks back, cached and evictable


def test_preloaded_sequences_go_round_a_head_the_pool_cannot_take():
    """The pool is held by two sequences a layered load filled; the head of
    the queue needs blocks: they run first (else none ever would)."""
    s = _scheduler(num_blocks=8, budget=16)
    head = _seq(1, 13)
    s.add(head)
    loaded = []
    for seq_id in (2, 3):
        seq = _seq(seq_id, 13)
        assert s.kv.allocate(seq_id, seq.token_ids, 13)  # 4 blocks each: the pool is full
        seq.preloaded_tokens = 12
        s.add(seq)
        loaded.append(seq)
    out = s.schedule()
    assert out.scheduled == {2: 1, 3: 1} and list(s.waiting) == [head]
    s.update(out, [SampledToken(2, 7), SampledToken(3, 7)])
    for seq in loaded:
        s.finish(seq, "stop")
    assert s.schedule().scheduled == {1: 13}  # their blocks back: the head goes now
