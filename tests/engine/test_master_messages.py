"""The master, in-process on real sockets (no workers: the test plays rank 0):
a request's own worker failure fails that request alone, and valid-but-bad
internal messages (forged StepDone, unknown ids, duplicates) are dropped,
never fatal."""

from __future__ import annotations

import pytest

from deepserve.messages.engine import (AddRequest, FinishRequest, StepDone, StepTokens,
                                       WorkerReady)
from deepserve.messages.pd import (CancelOrder, FailRequest, KVAck, KVEndpoint, KVReady, KVSent,
                                   PrefillOrder)
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import SampledToken, SeqFailed, StepOutput
from tests.engine.actor_harness import MasterHarness, drain


@pytest.fixture
def m(tiny_model, short_dir):
    harness = MasterHarness(str(tiny_model), short_dir, async_scheduling=False)
    yield harness
    harness.close()


def _add(m: MasterHarness, request_id: str, max_tokens: int = 4) -> None:
    m.send("master", AddRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True)))


def _seq_ids(m: MasterHarness) -> dict[str, int]:
    return {r: s.seq_id for r, s in m.master.core.seqs.items()}


def _done(step_id: int, sampled: dict[int, int], failed: dict[int, str] = {}) -> StepDone:
    return StepDone(output=StepOutput(step_id, [SampledToken(s, t) for s, t in sampled.items()],
                                      [SeqFailed(s, why) for s, why in failed.items()]),
                    forward_start=0.0, forward_end=0.0)


def _three_in_one_step(m: MasterHarness) -> tuple[dict[str, int], int]:
    """Requests a, b, c in one batch in flight: (their seq ids, its step id).
    a goes first and its prefill step is answered only once b and c are in
    the master's books, so the next step holds all three whatever the timing
    (ZeroMQ delivers asynchronously: three AddRequests sent at once may reach
    two different drains under load). a's first token is drained here."""
    _add(m, "a")
    m.step_until(lambda: len(m.master.in_flight) == 1 and "a" in m.master.core.seqs)
    first = m.master.in_flight[0][0]
    _add(m, "b")
    _add(m, "c")
    m.step_until(lambda: len(m.master.core.seqs) == 3)
    m.send("steps", _done(first, {_seq_ids(m)["a"]: 4}))
    m.step_until(lambda: m.master.in_flight and m.master.in_flight[0][0] != first)
    step_id, scheduled = m.master.in_flight[0][0], m.master.in_flight[0][1].scheduled
    assert len(scheduled) == 3  # one batch
    drain(m.to_tokenizer)
    return _seq_ids(m), step_id


def test_a_worker_failure_of_one_seq_fails_that_request_only(m):
    ids, step = _three_in_one_step(m)
    m.send("steps", _done(step, {ids["a"]: 5, ids["c"]: 6}, {ids["b"]: "TypeError: bad top_k"}))
    m.step_until(lambda: "b" not in m.master.core.seqs)
    got = drain(m.to_tokenizer)
    fails = [x for x in got if isinstance(x, FailRequest)]
    assert [(f.request_id, f.error) for f in fails] == [("b", "request_failed")]
    assert "TypeError: bad top_k" in fails[0].message
    tokens = [i for x in got if isinstance(x, StepTokens) for i in x.items]
    assert [(i.request_id, i.token_ids) for i in tokens] == [("a", [5]), ("c", [6])]
    # the others go on to the end
    _run_to_end(m)
    ended = {i.request_id: i.finish_reason for x in drain(m.to_tokenizer)
             if isinstance(x, StepTokens) for i in x.items if i.finish_reason}
    assert ended == {"a": "length", "c": "length"}
    m.master.kv.check_integrity()


def _run_to_end(m: MasterHarness) -> None:
    """Play rank 0 (token 7 for every sampling seq) until no request is left."""
    while m.master.core.seqs:
        m.step_until(lambda: m.master.in_flight)
        step_id, _, sampling_ids = m.master.in_flight[0]
        m.send("steps", _done(step_id, {s: 7 for s in sampling_ids}))
        m.step_until(lambda: not m.master.in_flight or m.master.in_flight[0][0] != step_id)


# -- valid-but-bad messages: dropped, never fatal --------------------------------------
def test_forged_step_done_for_unknown_steps_and_seqs_is_dropped(m):
    ids, step = _three_in_one_step(m)
    a, b, c = ids["a"], ids["b"], ids["c"]
    done_before = m.master.num_steps
    forged = [_done(step + 5, {a: 1, b: 1, c: 1}),     # no such step
              _done(step, {a: 1, b: 1, c: 1, 999: 1}),  # an unknown seq
              _done(step, {a: 1, b: 1}),                # a sampling seq missing
              _done(step, {a: 1, b: 1}, {a: "x"})]      # a seq answered twice
    for msg in forged:
        m.send("steps", msg)
    m.step(6)
    assert len(m.master.in_flight) == 1 and m.master.num_steps == done_before
    assert not [x for x in drain(m.to_tokenizer) if isinstance(x, StepTokens)]
    m.send("steps", _done(step, {a: 5, b: 6, c: 7}))  # the real answer still counts
    m.step_until(lambda: m.master.num_steps == done_before + 1)
    m.send("steps", _done(step, {a: 5, b: 6, c: 7}))  # and a replay of it does not
    m.step(3)
    assert m.master.num_steps == done_before + 1
    _run_to_end(m)
    m.master.kv.check_integrity()


def test_unknown_ids_everywhere_are_ignored(m):
    _add(m, "a")
    m.send("master", FinishRequest(request_id="nobody", reason="abort"))
    m.send("steps", KVSent(rank=0, seq_id=4242))
    m.send("steps", WorkerReady(rank=0, pid=1))
    m.send("pd", KVReady(request_id="nobody", order_id=3, token_id=1))
    m.send("pd", KVAck(request_id="nobody", order_id=3))
    m.send("pd", CancelOrder(request_id="nobody", order_id=3))
    m.step(5)
    _run_to_end(m)
    assert [i.finish_reason for x in drain(m.to_tokenizer) for i in x.items][-1] == "length"


def test_bad_add_request_fails_cleanly(m):
    m.send("master", AddRequest(request_id="bad", prompt_token_ids=[10 ** 9],
                                sampling=SamplingParams()))
    m.send("master", AddRequest(request_id="bad2", prompt_token_ids=[1],
                                sampling=SamplingParams(), prefill_from="carrier-pigeon"))
    m.step(3)
    fails = drain(m.to_tokenizer)
    assert [(f.request_id, f.error) for f in fails] == [("bad", "invalid_request"),
                                                       ("bad2", "invalid_request")]
    assert not m.master.core.seqs and not m.master.scheduler.has_unfinished


def test_a_duplicate_request_id_ends_the_older_request(m):
    _add(m, "r", max_tokens=50)
    m.step_until(lambda: m.master.in_flight)
    old = m.master.core.seqs["r"]
    _add(m, "r", max_tokens=2)
    m.step(2)
    new = m.master.core.seqs["r"]
    assert new is not old and old.is_finished and old.finish_reason == "abort"
    _run_to_end(m)
    assert not m.master.core.seqs
    m.master.kv.check_integrity()


def test_prefill_order_never_takes_a_live_requests_slot(m):
    """The same request id served here and ordered as a prefill task from a
    peer: the peer's order is tracked apart, and an abort of the request
    reaches the request, not the order."""
    _add(m, "r", max_tokens=50)
    m.step_until(lambda: "r" in m.master.core.seqs)
    mine = m.master.core.seqs["r"]
    m.send("pd", PrefillOrder(request_id="r", order_id=9, prompt_token_ids=[4, 5, 6, 7, 8],
                              sampling=SamplingParams(temperature=0), skip_blocks=0,
                              dst_block_ids=[3], dst_te="te-x",
                              dst_endpoints=[KVEndpoint(shape=(1,), dtype="float32", shm="y")],
                              reply_to=m.addresses["peer"]))
    m.step_until(lambda: m.master.pd.orders)
    assert m.master.core.seqs["r"] is mine
    m.send("master", FinishRequest(request_id="r", reason="abort"))
    m.step(2)
    assert mine.is_finished and m.master.pd.orders  # the order runs on
    [entry] = m.master.pd.orders.values()
    assert not entry.seq.is_finished
    m.send("pd", CancelOrder(request_id="r", order_id=9))  # the decode side dropped it
    m.step_until(lambda: not m.master.pd.orders)
    _run_to_end(m)
    answers = drain(m.peer)
    assert [(a.request_id, a.order_id, a.error) for a in answers] == [("r", 9, "cancelled")]
    assert not m.master.core.request_ids and not m.master.scheduler.has_unfinished
    m.master.kv.check_integrity()


def test_a_prefill_order_past_max_model_len_is_refused_for_good(m):
    """An order whose prompt this prefill TE cannot hold (its max_model_len can
    be its pool's, under its decode TE's) answers a KVReady that is no
    transfer failure: not retryable, code prompt_too_long. At max_model_len - 1
    tokens it is taken."""
    limit, bs = m.master.spec.config.max_model_len, m.master.spec.config.block_size

    def order(order_id: int, n: int) -> PrefillOrder:
        return PrefillOrder(request_id=f"r{order_id}", order_id=order_id,
                            prompt_token_ids=[5] * n, sampling=SamplingParams(temperature=0),
                            skip_blocks=0, dst_block_ids=list(range(-(-n // bs))),
                            dst_te="te-x",
                            dst_endpoints=[KVEndpoint(shape=(1,), dtype="float32", shm="y")],
                            reply_to=m.addresses["peer"])

    m.send("pd", order(1, limit))
    m.step(2)
    [ready] = drain(m.peer)
    assert (ready.request_id, ready.is_retryable, ready.code) == ("r1", False, "prompt_too_long")
    assert f"max_model_len is {limit}" in ready.error and not m.master.pd.orders
    m.send("pd", order(2, limit - 1))
    m.step_until(lambda: m.master.pd.orders)  # taken: it runs as a prefill task
