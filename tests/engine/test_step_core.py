"""StepCore: the bookkeeping LLMEngine and the master share, without a model."""

from __future__ import annotations

import pytest

from deepserve.config import EngineConfig
from deepserve.engine.sequence import SequenceStatus
from deepserve.engine.step_core import StepCore, check_request
from deepserve.errors import InvalidRequestError, PromptTooLongError
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import SampledToken

EOS = (2, 3)


@pytest.fixture
def core():
    config = EngineConfig(model="unused", block_size=4, num_kv_blocks=16, max_model_len=32,
                          max_num_batched_tokens=64)
    c = StepCore(config, EOS, vocab_size=100, record_events=True)
    yield c
    c.kv.check_integrity()


def test_stop_tokens_are_the_requests_own_plus_eos_unless_ignored(core):
    seq = core.add("a", [5, 6, 7], SamplingParams(stop_token_ids=[9]))
    assert seq.stop_token_ids == {9, 2, 3}
    seq = core.add("b", [5, 6, 7], SamplingParams(stop_token_ids=[9], ignore_eos=True))
    assert seq.stop_token_ids == {9}
    assert [s.seq_id for s in core.scheduler.waiting] == [0, 1]
    held = core.add("c", [5], SamplingParams(), schedule=False)  # a decode task
    assert core.seqs["c"] is held and held not in core.scheduler.waiting


@pytest.mark.parametrize("ids,sampling,error,param", [
    ([], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, 100], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, True], SamplingParams(), InvalidRequestError, "prompt"),
    (list(range(32)), SamplingParams(), PromptTooLongError, "prompt"),
    ([1, 2], SamplingParams(max_tokens=0), InvalidRequestError, "max_tokens"),
    ([1, 2], SamplingParams(stop_token_ids=[100]), InvalidRequestError, "stop_token_ids"),
])
def test_check_request_names_the_bad_field(ids, sampling, error, param):
    with pytest.raises(error) as e:
        check_request(ids, sampling, vocab_size=100, max_model_len=32)
    assert e.value.param == param


def test_a_request_id_in_use_is_refused_until_released(core):
    seq = core.add("a", [5, 6, 7], SamplingParams())
    with pytest.raises(InvalidRequestError) as e:
        core.check("a", [5, 6, 7], SamplingParams())
    assert e.value.param == "request_id"
    assert core.finish("a", "abort") is seq and seq.finish_reason == "abort"
    core.check("a", [5, 6, 7], SamplingParams())
    assert core.finish("a", "abort") is None


def test_release_happens_once_and_the_workers_hear_it_with_the_next_batch(core):
    a = core.add("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1))
    scheduled, batch = core.schedule()
    assert batch.step_id == 0 and [s.seq_id for s in batch.new_seqs] == [a.seq_id]
    core.scheduler.update(scheduled, [SampledToken(a.seq_id, 11)])
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "length"
    assert core.release(a) == "a" and core.release(a) is None
    assert core.seqs == {} and core.pop_finished() == ["a"] and core.pop_finished() == []
    assert (core.num_prompt_tokens, core.num_cached_tokens) == (5, 0)
    core.add("b", [5, 6, 7, 8, 9, 10], SamplingParams())
    _, batch = core.schedule()
    assert batch.step_id == 1 and batch.finished_seq_ids == [a.seq_id]
    assert core.schedule()[1].finished_seq_ids == []


def test_releasing_an_earlier_sequence_keeps_a_later_one_under_the_same_id(core):
    first = core.add("r", [5, 6], SamplingParams())
    second = core.add("r", [5, 6], SamplingParams())  # e.g. a prefill order's next attempt
    core.scheduler.finish(first, "abort")
    assert core.release(first) == "r"
    assert core.seqs == {"r": second} and core.request_ids == {second.seq_id: "r"}
    assert core.pop_finished() == ["r"]
