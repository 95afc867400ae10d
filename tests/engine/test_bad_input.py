"""Bad input: a typed exception naming the problem, before the request is
queued; requests already in the engine carry on."""

import pytest

from deepserve import InvalidRequestError, PromptTooLongError, SamplingParams

BAD_SAMPLING = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=100), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[10 ** 9]), "stop_token_ids"),
]


@pytest.mark.parametrize("fields,param", BAD_SAMPLING)
def test_bad_sampling_field_is_rejected_by_name(tiny_llm, fields, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        tiny_llm.generate("hello", SamplingParams(**fields))
    assert info.value.param == param


@pytest.mark.parametrize("prompt", ["", [], [-1], [10 ** 9]])
def test_empty_or_invalid_prompt(tiny_llm, prompt):
    with pytest.raises(InvalidRequestError) as info:
        tiny_llm.generate([prompt])
    assert info.value.param == "prompt"


def test_prompt_longer_than_max_model_len(tiny_model):
    from deepserve import LLM

    llm = LLM(str(tiny_model), max_model_len=64, num_kv_blocks=16)
    with pytest.raises(PromptTooLongError, match="max_model_len is 64"):
        llm.generate([[5] * 64])
    assert llm.generate([[5] * 63], SamplingParams(max_tokens=8))[0].finish_reason == "length"


def test_running_requests_continue_past_a_rejected_one(tiny_llm):
    engine = tiny_llm.engine
    good = engine.add_request("def main():", SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    for bad in (dict(prompt=""), dict(prompt="ok", sampling=SamplingParams(top_p=2.0))):
        with pytest.raises(InvalidRequestError):
            engine.add_request(**bad)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [good] and len(outs[0].token_ids) == 8
    engine.kv.check_integrity()


def test_a_bad_prompt_in_a_batch_queues_nothing(tiny_llm):
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate(["fine", "also fine", ""])
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.kv.num_free_blocks == tiny_llm.engine.kv.num_blocks


def test_unknown_engine_option_is_named(tiny_model):
    from deepserve import LLM

    with pytest.raises(ValueError, match="num_kv_blockz"):
        LLM(str(tiny_model), num_kv_blockz=4)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_model), block_size=0)
