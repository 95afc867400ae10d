"""Sampling parameters and stopping, end to end through the engine."""

import pytest

from deepserve import LLM, SamplingParams

PROMPTS = ["def parse(line):", "import re\n", "while True:"]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    alone = tiny_llm.generate(PROMPTS[0], sp)[0]
    with_others = tiny_llm.generate(PROMPTS, [sp, SamplingParams(temperature=1.0, max_tokens=8),
                                              SamplingParams(temperature=0, max_tokens=4)])[0]
    assert alone.token_ids == with_others.token_ids
    other_seed = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=99,
                                                              max_tokens=16))[0]
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_is_greedy(tiny_llm):
    greedy = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    top1 = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, seed=3,
                                                     max_tokens=12))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_stop_string_ends_generation_and_is_not_in_text(tiny_llm):
    base = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20))[0]
    assert len(base.text) > 6
    stop = base.text[4:7]  # a piece of what the model will write
    out = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20,
                                                       stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:base.text.find(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(base.token_ids)


def test_stop_token_ids_and_max_tokens(tiny_llm):
    base = tiny_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_id = base.token_ids[3]
    out = tiny_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10,
                                                       stop_token_ids=[stop_id]))[0]
    first = base.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]


def test_eos_stops_unless_ignore_eos(tiny_model):
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    eos = llm.engine.model_config.eos_token_ids[0]
    base = llm.generate("x", SamplingParams(temperature=0, max_tokens=6))[0]
    # Pretend the model's EOS is the 2nd greedy token: generation must stop there.
    llm.engine.core.eos_token_ids = frozenset({base.token_ids[1]})  # where stops are assembled
    stopped = llm.generate("x", SamplingParams(temperature=0, max_tokens=6))[0]
    assert stopped.token_ids == base.token_ids[:2] and stopped.finish_reason == "stop"
    ignored = llm.generate("x", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    assert eos not in base.token_ids[:1]


def test_logprobs_of_sampled_tokens(tiny_llm):
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5,
                                                       logprobs=3))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely
        assert lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert tiny_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].logprobs is None


def test_chat_applies_the_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "Hello"}],
                        SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    im_start = tiny_llm.tokenizer.token_to_id("<|im_start|>")
    assert out.prompt_token_ids[0] == im_start
    assert out.prompt_token_ids.count(im_start) == 2
    assert len(out.token_ids) == 4
