"""engine/pd/coordinator.py as a pure policy object: real KVCacheManager and Scheduler,
a fake clock, no processes. Every test ends with the cache's integrity check."""

from __future__ import annotations

import msgspec
import pytest

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.pd.coordinator import PDCoordinator
from deepserve.engine.scheduler import Scheduler
from deepserve.engine.sequence import Sequence, SequenceStatus
from deepserve.messages.pd import (CancelOrder, KVAck, KVEndpoint, KVReady, KVSent,
                                   PrefillOrder, pd_address)
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import SampledToken

BS, TIMEOUT = 4, 2.0
ME, PEER = "ipc://run/d.pd.sock", "ipc://run/p.pd.sock"
EP = KVEndpoint(shape=(2, 1, 1, 16, BS, 8), dtype="float32", shm="deepserve-x-kv")
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = list(range(100, 109))  # 9 tokens: 3 blocks


class Env:
    def __init__(self, num_blocks: int = 8, tp: int = 1):
        self.kv = KVCacheManager(num_blocks, BS)
        self.scheduler = Scheduler(self.kv, 64, 8, 64)
        self.pd = PDCoordinator(self.kv, self.scheduler, te_id="te-d", tp=tp, max_model_len=64,
                                kv_transfer_timeout_s=TIMEOUT, address=ME,
                                endpoints=[EP] * tp)
        self.seq_ids = iter(range(1000))

    def seq(self, ids=PROMPT, salt=None) -> Sequence:
        return Sequence(next(self.seq_ids), ids, PARAMS, frozenset(), salt)

    def decode(self, request_id: str = "r", ids=PROMPT, salt=None, now: float = 0.0):
        seq = self.seq(ids, salt)
        return seq, self.pd.add_decode(request_id, seq, PEER, now)


@pytest.fixture
def env():
    e = Env()
    yield e
    e.kv.check_integrity()


def _order(effects) -> PrefillOrder:
    [(address, order)] = effects.sends
    assert address == PEER and isinstance(order, PrefillOrder)
    return order


# -- decode side -------------------------------------------------------------------
def test_decode_task_orders_its_blocks_and_adopts_the_kv(env):
    seq, effects = env.decode(salt="tenant-a")
    order = _order(effects)
    assert (order.request_id, order.skip_blocks, order.dst_te) == ("r", 0, "te-d")
    assert order.reply_to == ME
    assert order.dst_block_ids == env.kv.block_table(seq.seq_id) == [0, 1, 2]
    assert order.salt == "tenant-a" and order.prompt_token_ids == PROMPT
    assert env.pd.has_work and not env.scheduler.has_unfinished
    fx = env.pd.on_kv_ready(KVReady(request_id="r", order_id=order.order_id, token_id=7,
                                    cached_tokens=4, reply_to=PEER))
    assert fx.sends == [(PEER, KVAck(request_id="r", order_id=order.order_id))]
    assert fx.emit == [seq] and fx.released == [] and fx.failed == []
    assert seq.token_ids == PROMPT + [7] and seq.num_computed_tokens == 9
    assert seq.status is SequenceStatus.RUNNING and env.scheduler.running == [seq]
    assert env.kv.num_shared_blocks(seq.seq_id) == 2  # its full blocks joined the tree
    assert not env.pd.has_work


def test_decode_kv_that_never_arrives_fails_at_the_deadline(env):
    seq, effects = env.decode(now=10.0)
    order = _order(effects)
    assert not env.pd.poll(10.0 + TIMEOUT)  # on the deadline: still waiting
    fx = env.pd.poll(10.0 + TIMEOUT + 0.01)
    [fail] = fx.failed
    assert (fail.request_id, fail.error) == ("r", "kv_transfer_failed")
    assert "did not arrive" in fail.message
    assert fx.released == [seq] and seq.is_finished
    # the prefill TE is told, and the blocks stay fenced: it may still write them
    assert fx.sends == [(PEER, CancelOrder(request_id="r", order_id=order.order_id))]
    assert env.kv.has_seq(seq.seq_id) and env.kv.num_free_blocks == 5
    late = env.pd.on_kv_ready(KVReady(request_id="r", order_id=order.order_id, token_id=7,
                                      reply_to=PEER))
    assert late.sends == [(PEER, KVAck(request_id="r", order_id=order.order_id))]
    assert not (late.emit or late.released or late.failed)
    assert not env.kv.has_seq(seq.seq_id) and env.kv.num_free_blocks == 8  # unfenced


def test_kv_ready_with_an_error_fails_the_request(env):
    seq, effects = env.decode()
    order = _order(effects)
    fx = env.pd.on_kv_ready(KVReady(request_id="r", order_id=order.order_id, error="boom",
                                    reply_to=PEER))
    assert fx.sends == [(PEER, KVAck(request_id="r", order_id=order.order_id))]
    [fail] = fx.failed
    assert fail.error == "kv_transfer_failed" and "boom" in fail.message
    assert fx.released == [seq] and fx.emit == [] and not env.kv.has_seq(seq.seq_id)


def test_a_prefill_tes_refusal_is_the_callers_error_not_a_transfer_failure(env):
    """KVReady.code of a refusal (not retryable): the request fails with that
    code and the prefill TE's words; a code on a retryable failure, or one
    that names no refusal, changes nothing."""
    for code, retryable, error in (("prompt_too_long", False, "prompt_too_long"),
                                   ("invalid_request", False, "invalid_request"),
                                   ("prompt_too_long", True, "kv_transfer_failed"),
                                   ("engine_dead", False, "request_failed")):
        seq, effects = env.decode()
        fx = env.pd.on_kv_ready(KVReady(request_id="r", order_id=_order(effects).order_id,
                                        error="prompt has 9 tokens", is_retryable=retryable,
                                        code=code))
        [fail] = fx.failed
        assert fail.error == error and fail.message.endswith("prompt has 9 tokens")
        assert (fail.message == "prompt has 9 tokens") == (error == code)
        assert fx.released == [seq] and not env.kv.has_seq(seq.seq_id)


def test_blocked_order_waits_for_blocks_then_goes_exactly_once():
    env = Env(num_blocks=4)
    hog = env.seq(list(range(12)))
    assert env.kv.allocate(hog.seq_id, hog.token_ids, 12)  # 3 of 4 blocks
    seq, effects = env.decode()  # needs 3
    assert not effects and env.pd.blocked and not env.kv.has_seq(seq.seq_id)
    assert not env.pd.poll(0.5)
    env.kv.free(hog.seq_id)
    order = _order(env.pd.poll(1.0))
    assert order.dst_block_ids == env.kv.block_table(seq.seq_id)
    assert not env.pd.poll(1.5) and not env.pd.blocked  # exactly one order
    env.kv.check_integrity()


def test_blocked_order_past_its_deadline_fails_without_ordering():
    env = Env(num_blocks=4)
    hog = env.seq(list(range(12)))
    assert env.kv.allocate(hog.seq_id, hog.token_ids, 12)
    seq, _ = env.decode()
    env.kv.free(hog.seq_id)  # blocks free up, but too late
    fx = env.pd.poll(TIMEOUT + 1)
    assert fx.sends == [] and [f.request_id for f in fx.failed] == ["r"]
    assert fx.released == [seq] and env.kv.num_free_blocks == 4 and not env.pd.blocked
    env.kv.check_integrity()


def _warm_prefix(env: Env, salt) -> None:
    """A finished earlier request left the prompt's full blocks in the tree."""
    old = env.seq(salt=salt)
    assert env.kv.allocate(old.seq_id, old.token_ids, len(PROMPT), salt)
    env.kv.commit(old.seq_id, old.token_ids, len(PROMPT))
    env.kv.free(old.seq_id)


@pytest.mark.parametrize("salt,skip", [("tenant-a", 2), ("tenant-b", 0), (None, 0)])
def test_prefix_hits_are_skipped_only_under_the_same_salt(env, salt, skip):
    _warm_prefix(env, "tenant-a")
    seq, effects = env.decode(salt=salt)
    order = _order(effects)
    assert order.salt == salt and order.skip_blocks == skip
    assert order.dst_block_ids == env.kv.block_table(seq.seq_id)[skip:]
    assert len(order.dst_block_ids) == 3 - skip


def test_abort_while_awaiting_frees_and_a_late_answer_is_only_acked(env):
    seq, effects = env.decode()
    order = _order(effects)
    assert env.pd.drop_decode("unknown", 1.0) is None
    fx = env.pd.drop_decode("r", 1.0)
    assert fx.released == [seq] and not fx.failed and env.kv.has_seq(seq.seq_id)  # fenced
    assert fx.sends == [(PEER, CancelOrder(request_id="r", order_id=order.order_id))]
    assert seq.is_finished and not env.pd.has_work
    late = env.pd.on_kv_ready(KVReady(request_id="r", order_id=order.order_id, token_id=3,
                                      reply_to=PEER))
    assert [type(m) for _, m in late.sends] == [KVAck] and not late.emit
    assert not env.kv.has_seq(seq.seq_id) and not env.pd.fenced


def test_a_late_answer_to_an_earlier_attempt_never_reaches_the_next(env):
    first, effects = env.decode()
    first_order = _order(effects)
    env.pd.drop_decode("r", 0.0)  # e.g. the JE retried the request
    second, effects = env.decode()
    second_order = _order(effects)
    assert second_order.order_id != first_order.order_id
    stale = env.pd.on_kv_ready(KVReady(request_id="r", order_id=first_order.order_id,
                                       token_id=3, reply_to=PEER))
    assert stale.sends == [(PEER, KVAck(request_id="r", order_id=first_order.order_id))]
    assert not stale.emit and env.pd.has_work and second.status is SequenceStatus.WAITING
    fx = env.pd.on_kv_ready(KVReady(request_id="r", order_id=second_order.order_id,
                                    token_id=5, reply_to=PEER))
    assert fx.emit == [second] and second.token_ids[-1] == 5


# -- prefill side ------------------------------------------------------------------
def _prefill_order(request_id="p", order_id=7, skip=0, dst=(10, 11, 12), tp=1) -> PrefillOrder:
    return PrefillOrder(request_id=request_id, order_id=order_id, prompt_token_ids=PROMPT,
                        sampling=PARAMS, salt="s", skip_blocks=skip, dst_block_ids=list(dst),
                        dst_te="te-x", dst_endpoints=[EP] * tp, reply_to=PEER)


def _run_prefill(env: Env, order: PrefillOrder, token: int = 9) -> Sequence:
    """Start the order and run its one step; return the prefill sequence."""
    fx = env.pd.add_prefill(order, seq_id=50)
    [(request_id, seq)] = fx.started
    assert request_id == order.request_id and env.scheduler.waiting[0] is seq
    assert seq.sampling.max_tokens == 1 and seq.keep_kv and seq.salt == "s"
    scheduled = env.scheduler.schedule()
    batch = scheduled.to_step_batch(0, env.kv, [])
    env.pd.attach_transfers(batch)
    [t] = batch.transfers
    assert t.src_block_ids == env.kv.block_table(seq.seq_id)[order.skip_blocks:]
    assert (t.seq_id, t.dst_block_ids, t.dst_te) == (50, order.dst_block_ids, "te-x")
    env.scheduler.on_dispatched(scheduled)
    assert env.scheduler.on_sampled(scheduled, [SampledToken(50, token)]) == [seq]
    assert seq.is_finished and env.kv.has_seq(50)  # finished, KV kept for the transfer
    assert env.pd.is_prefill(seq)
    return seq


def test_prefill_answers_once_token_and_every_rank_are_in_and_frees_on_ack():
    env = Env(tp=2)
    seq = _run_prefill(env, _prefill_order(tp=2))
    assert not env.pd.on_first_token(seq, now=1.0)  # no rank has sent yet
    assert not env.pd.on_kv_sent(KVSent(rank=0, seq_id=50, nbytes=100, seconds=0.1), 1.0)
    fx = env.pd.on_kv_sent(KVSent(rank=1, seq_id=50, nbytes=100, seconds=0.2), 1.0)
    [(address, ready)] = fx.sends
    assert address == PEER and ready == KVReady(request_id="p", order_id=7, token_id=9,
                                                nbytes=200, seconds=0.2, reply_to=ME)
    assert env.pd.pop_transfer_stats() == (200, [0.2])
    assert not env.pd.on_kv_ack(KVAck(request_id="p", order_id=6)) and env.kv.has_seq(50)
    assert not env.pd.on_kv_ack(KVAck(request_id="p", order_id=7))  # nothing to release
    assert not env.kv.has_seq(50) and env.kv.num_free_blocks == 8
    env.kv.check_integrity()


def test_unacked_prefill_copy_is_freed_at_the_timeout(env):
    seq = _run_prefill(env, _prefill_order())
    env.pd.on_kv_sent(KVSent(rank=0, seq_id=50, nbytes=1, seconds=0.1), 5.0)
    assert [type(m) for _, m in env.pd.on_first_token(seq, 5.0).sends] == [KVReady]
    env.pd.poll(5.0 + TIMEOUT)
    assert env.kv.has_seq(50)
    env.pd.poll(5.0 + TIMEOUT + 0.01)
    assert not env.kv.has_seq(50) and env.kv.num_free_blocks == 8


def test_failed_transfer_before_the_token_stops_the_prefill_task(env):
    fx = env.pd.add_prefill(_prefill_order(), seq_id=50)
    [(_, seq)] = fx.started
    scheduled = env.scheduler.schedule()
    env.pd.attach_transfers(scheduled.to_step_batch(0, env.kv, []))
    fx = env.pd.on_kv_sent(KVSent(rank=0, seq_id=50, error="link down"), 1.0)
    assert fx.sends == []  # the token is not in yet
    seq_token = env.pd.on_first_token(seq, 1.0)  # not finished: nothing happens
    assert not seq_token
    env.scheduler.on_dispatched(scheduled)
    env.scheduler.on_sampled(scheduled, [SampledToken(50, 4)])
    fx = env.pd.on_first_token(seq, 1.5)
    [(_, ready)] = fx.sends
    assert ready.error == "KV transfer failed: rank 0: link down" and ready.order_id == 7
    assert not env.kv.has_seq(50) and not env.pd.is_prefill(seq)


def test_bad_order_is_answered_with_an_error_and_starts_nothing(env):
    fx = env.pd.add_prefill(_prefill_order(tp=2), seq_id=50)
    [(address, ready)] = fx.sends
    assert address == PEER and "2 ranks" in ready.error and ready.order_id == 7
    assert not fx.started and not env.scheduler.has_unfinished
    fx = env.pd.add_prefill(_prefill_order(skip=1), seq_id=51)  # 3 dst ids for 2 blocks
    assert "3 destination blocks for 2" in fx.sends[0][1].error


def test_pd_address_is_derived_from_the_inbox():
    assert pd_address("ipc:///tmp/run/te1.sock") == "ipc:///tmp/run/te1.pd.sock"
    assert pd_address("ipc:///tmp/run/inbox") == "ipc:///tmp/run/inbox.pd.sock"
    assert pd_address("tcp://10.0.0.2:5000") == "tcp://10.0.0.2:5001"
    with pytest.raises(ValueError):
        pd_address("inproc://x")


# -- dropped orders: cancel, fence, never a write into someone else's blocks ---------
def test_dropped_order_blocks_go_to_no_one_until_the_prefill_side_answers():
    env = Env(num_blocks=4)
    first, effects = env.decode("r1")
    order = _order(effects)
    fx = env.pd.drop_decode("r1", 1.0)  # the client went away
    assert fx.sends == [(PEER, CancelOrder(request_id="r1", order_id=order.order_id))]
    second, effects = env.decode("r2", ids=list(range(200, 209)), now=1.0)
    assert not effects.sends and env.pd.blocked  # the fenced blocks are not handed out
    assert not env.pd.poll(1.5).sends
    done = env.pd.on_kv_ready(KVReady(request_id="r1", order_id=order.order_id,
                                      error="cancelled"))
    assert not done.sends and not done.failed  # nothing to ack, nobody to fail
    assert not env.kv.has_seq(first.seq_id)
    order2 = _order(env.pd.poll(1.6))
    assert order2.request_id == "r2" and set(order2.dst_block_ids) & set(order.dst_block_ids)
    env.kv.check_integrity()


def test_fence_without_an_answer_lifts_after_one_more_timeout():
    env = Env(num_blocks=4)
    seq, effects = env.decode("r1")
    env.pd.drop_decode("r1", 5.0)
    env.pd.poll(5.0 + TIMEOUT)
    assert env.kv.has_seq(seq.seq_id)
    env.pd.poll(5.0 + TIMEOUT + 0.01)
    assert not env.kv.has_seq(seq.seq_id) and not env.pd.fenced
    assert env.kv.num_free_blocks == 4
    env.kv.check_integrity()


def test_a_blocked_order_dropped_before_it_went_out_needs_no_cancel():
    env = Env(num_blocks=2)
    seq, effects = env.decode("r1")  # 3 blocks needed, 2 in the pool: blocked
    assert not effects
    fx = env.pd.drop_decode("r1", 1.0)
    assert fx.sends == [] and not env.pd.fenced and fx.released == [seq]
    env.kv.check_integrity()


def test_cancel_before_dispatch_stops_the_prefill_and_answers_at_once(env):
    fx = env.pd.add_prefill(_prefill_order(), seq_id=50)
    [(_, seq)] = fx.started
    fx = env.pd.on_cancel(CancelOrder(request_id="p", order_id=6), 1.0)
    assert not fx and env.pd.is_prefill(seq)  # another attempt's cancel: ignored
    fx = env.pd.on_cancel(CancelOrder(request_id="p", order_id=7), 1.0)
    [(address, ready)] = fx.sends
    assert address == PEER and ready.error == "cancelled" and ready.order_id == 7
    assert fx.released == [seq] and seq.is_finished and not env.scheduler.has_unfinished
    assert not env.kv.has_seq(50) and not env.pd.is_prefill(seq)
    batch = env.scheduler.schedule()
    assert batch.is_empty  # never runs, so never transfers


def test_cancel_after_dispatch_answers_only_once_every_rank_has_written():
    env = Env(tp=2)
    fx = env.pd.add_prefill(_prefill_order(tp=2), seq_id=50)
    [(_, seq)] = fx.started
    scheduled = env.scheduler.schedule()
    batch = scheduled.to_step_batch(0, env.kv, [])
    env.pd.attach_transfers(batch)
    env.scheduler.on_dispatched(scheduled)
    fx = env.pd.on_cancel(CancelOrder(request_id="p", order_id=7), 1.0)
    assert fx.sends == [] and fx.released == [seq]  # rank writes may be under way
    assert env.scheduler.on_sampled(scheduled, [SampledToken(50, 4)]) == []  # stopped
    assert not env.pd.on_kv_sent(KVSent(rank=0, seq_id=50, nbytes=1), 1.1).sends
    fx = env.pd.on_kv_sent(KVSent(rank=1, seq_id=50, nbytes=1), 1.2)
    [(_, ready)] = fx.sends
    assert ready.error == "cancelled" and ready.reply_to == ""  # never adopted, no ack
    assert not env.kv.has_seq(50) and not env.pd.orders
    env.kv.check_integrity()


def test_cancel_of_an_answered_order_frees_the_copy_like_an_ack(env):
    seq = _run_prefill(env, _prefill_order())
    env.pd.on_kv_sent(KVSent(rank=0, seq_id=50, nbytes=1, seconds=0.1), 1.0)
    assert [m.error for _, m in env.pd.on_first_token(seq, 1.0).sends] == [None]
    fx = env.pd.on_cancel(CancelOrder(request_id="p", order_id=7), 1.5)
    assert not fx.sends and not env.kv.has_seq(50) and not env.pd.orders


def test_a_duplicate_order_is_ignored(env):
    order = _prefill_order()
    assert env.pd.add_prefill(order, seq_id=50).started
    fx = env.pd.add_prefill(order, seq_id=51)
    assert not fx and list(env.pd.orders) == [50] and len(env.scheduler.waiting) == 1


def test_a_prefill_failed_in_a_worker_answers_with_an_error(env):
    fx = env.pd.add_prefill(_prefill_order(), seq_id=50)
    [(_, seq)] = fx.started
    scheduled = env.scheduler.schedule()
    env.pd.attach_transfers(scheduled.to_step_batch(0, env.kv, []))
    env.scheduler.on_dispatched(scheduled)
    fx = env.pd.on_prefill_failed(seq, "TypeError: bad top_k")
    assert fx.sends == [] and fx.released == [seq]  # rank 0 has not reported yet
    fx = env.pd.on_kv_sent(KVSent(rank=0, seq_id=50, nbytes=1), 1.0)
    [(_, ready)] = fx.sends
    assert ready.error == "prefill failed: TypeError: bad top_k" and not env.kv.has_seq(50)
    assert not ready.is_retryable  # the decode side fails the request for good:
    decode = Env()
    seq, effects = decode.decode("p")
    fx = decode.pd.on_kv_ready(msgspec.structs.replace(ready, order_id=_order(effects).order_id))
    [fail] = fx.failed
    assert fail.error == "request_failed" and "bad top_k" in fail.message
    assert not decode.kv.has_seq(seq.seq_id)
