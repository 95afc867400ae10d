"""Sampling parameters and stopping, end to end through the engine."""

import math

import pytest

from deepserve import LLM, InvalidRequestError, SamplingParams

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


# --- Numerically hostile but valid values: no request of death (issue 11) ---

TINY = [1e-300, 5e-324, 1e-45, 1e-8]  # below the greedy epsilon: act as temperature 0
BOUNDARY = [
    *[dict(temperature=t) for t in TINY],
    dict(temperature=0.0), dict(temperature=2.0),
    *[dict(temperature=1.0, top_p=p) for p in (1e-300, 5e-324, 1e-8, 1.0)],
    *[dict(temperature=1.0, top_k=k) for k in (-1, 0, 1, 2, 2**31)],
    *[dict(temperature=t, logprobs=n) for t in (1e-300, 0.0, 2.0) for n in (0, 20)],
    *[dict(temperature=1.0, seed=s) for s in (-2**63, -1, 0, 2**63 - 1)],
    dict(temperature=1e-300, top_p=5e-324, top_k=1, logprobs=20, seed=2**63 - 1),
]


@pytest.fixture(scope="module")
def hostile_llm(tiny_model):
    """Its own engine, so a failure here cannot poison the shared tiny_llm."""
    return LLM(str(tiny_model), num_kv_blocks=128, max_num_batched_tokens=256)


def _assert_sane(out, vocab_size: int, max_tokens: int) -> None:
    assert len(out.token_ids) == max_tokens or out.finish_reason == "stop"
    assert all(0 <= t < vocab_size for t in out.token_ids)
    for lp in out.logprobs or []:
        assert math.isfinite(lp.logprob) and lp.logprob <= 0.0
        assert all(0 <= t < vocab_size and math.isfinite(v) for t, v in lp.top)


@pytest.mark.parametrize("fields", BOUNDARY, ids=str)
def test_boundary_values_generate_and_the_engine_keeps_serving(hostile_llm, fields):
    vocab = hostile_llm.engine.model_config.vocab_size
    out = hostile_llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, **fields))[0]
    _assert_sane(out, vocab, 6)
    if fields.get("logprobs") is not None:
        assert len(out.logprobs) == len(out.token_ids)
        assert all(len(lp.top) == fields["logprobs"] for lp in out.logprobs)
    normal = hostile_llm.generate(PROMPTS[1], SamplingParams(temperature=0.7, seed=5,
                                                             max_tokens=6))[0]
    _assert_sane(normal, vocab, 6)


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_is_exactly_greedy(hostile_llm, temperature):
    greedy = hostile_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    tiny = hostile_llm.generate(PROMPTS, SamplingParams(temperature=temperature, seed=7,
                                                        max_tokens=10))
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


@pytest.mark.parametrize("top_p", [1e-300, 5e-324])
def test_tiny_top_p_keeps_only_the_top_token(hostile_llm, top_p):
    greedy = hostile_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    nucleus = hostile_llm.generate(PROMPTS, SamplingParams(temperature=2.0, top_p=top_p,
                                                           seed=11, max_tokens=10))
    assert [o.token_ids for o in nucleus] == [o.token_ids for o in greedy]


def test_n_at_its_limit_with_hostile_values(hostile_llm):
    """n = 8 (the API's max) choices of one request: eight seeded rows in one batch."""
    vocab = hostile_llm.engine.model_config.vocab_size
    params = [SamplingParams(temperature=t, top_p=p, seed=2**63 - 1 - i, logprobs=20,
                             max_tokens=5)
              for i, (t, p) in enumerate([(1e-300, 1.0), (2.0, 5e-324), (5e-324, 1e-300),
                                          (2.0, 1.0), (1e-45, 0.5), (0.0, 1.0), (1e-8, 1e-8),
                                          (2.0, 0.999)])]
    outs = hostile_llm.generate([PROMPTS[2]] * 8, params)
    for out in outs:
        _assert_sane(out, vocab, 5)


@pytest.mark.parametrize("fields,param", [(dict(temperature=float("nan")), "temperature"),
                                          (dict(temperature=float("inf")), "temperature"),
                                          (dict(seed=2**64), "seed"),
                                          (dict(seed=-2**63 - 1), "seed")])
def test_values_that_cannot_be_made_safe_are_rejected_by_name(hostile_llm, fields, param):
    """The HTTP API already refuses these; an in-process caller gets the same error."""
    with pytest.raises(InvalidRequestError) as info:
        hostile_llm.generate("hello", SamplingParams(**fields))
    assert info.value.param == param


@pytest.mark.slow
def test_requests_of_death_do_not_kill_a_process_te(tiny_model):
    import psutil

    with LLM(str(tiny_model), processes=True, num_kv_blocks=128, max_num_batched_tokens=48,
             startup_timeout_s=90) as llm:
        pids = dict(llm.client.launcher.pids)
        hostile = [SamplingParams(temperature=1e-300, max_tokens=6),
                   SamplingParams(temperature=1.0, top_p=5e-324, max_tokens=6),
                   SamplingParams(temperature=5e-324, top_p=1e-300, logprobs=20, max_tokens=6)]
        greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))[0]
        outs = llm.generate([PROMPTS[0]] * 3, hostile)
        assert [o.token_ids for o in outs] == [greedy.token_ids] * 3
        normal = llm.generate(PROMPTS[1], SamplingParams(temperature=0.8, seed=1, max_tokens=6))
        assert len(normal[0].token_ids) == 6
        assert llm.client.launcher.pids == pids
        for pid in pids.values():
            assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
