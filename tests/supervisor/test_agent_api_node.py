"""Structured outputs through a real node on the built-in model (SmolLM2),
with the openai client: every spelling of a grammar is honored, streamed or
not, with n > 1; a grammar that does not compile is a 400 naming its field
before anything is generated; a vLLM field we do not implement is a 400 and
a field nobody knows is named in a header. Tools: named and required
choices, streamed, and a history on a template without tools; instructor
in JSON_SCHEMA and TOOLS modes. Log-likelihoods: echo with logprobs and
prompt_logprobs equal transformers' on the same weights (fp32), directly and
through lm-evaluation-harness's local-completions, with a list of prompts."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec
from tests.supervisor.test_node import _metrics

pytestmark = pytest.mark.slow  # starts a process tree

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Describe a person named Ann, aged 31, as JSON."}]


@pytest.fixture(scope="module")
def model_dir(smollm2_dir) -> Path:
    return smollm2_dir


@pytest.fixture(scope="module")
def node(model_dir):
    model = model_dir
    # float32: log-likelihoods are compared with transformers' fp32 ones
    options = {"max_num_batched_tokens": 512, "num_kv_blocks": 128, "max_model_len": 1024,
               "dtype": "float32"}
    # a host tier (64 MiB, about 90 fp32 blocks) for turn pins; every hit fetched from it
    node = Node(NodeConfig.build(model=str(model), served_model="smol", port=free_port(),
                                 startup_timeout_s=180, te_timeout_s=10,
                                 host_cache_bytes=64 << 20, cache_cost_model=False,
                                 tes=[TESpec("te0", "colocated", options)]))
    node.start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def client(node) -> OpenAI:
    return OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _person(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    return value


def test_response_format_json_schema(client):
    resp = client.chat.completions.create(
        model="smol", messages=ASK, temperature=0, max_tokens=60,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert resp.choices[0].finish_reason == "stop"
    assert _person(resp.choices[0].message.content)["name"]


def test_json_schema_streamed_with_two_sampled_choices(client):
    chunks = list(client.chat.completions.create(
        model="smol", messages=ASK, temperature=0.8, seed=3, max_tokens=80, n=2, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}}))
    texts, finishes = ["", ""], [None, None]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert finishes == ["stop", "stop"]
    for text in texts:
        _person(text)


def test_json_mode(client):
    ask = [{"role": "user", "content": 'Answer in JSON: {"capital": ...}. '
                                       "What is the capital of France?"}]
    resp = client.chat.completions.create(model="smol", messages=ask, temperature=0,
                                          max_tokens=100, response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
     lambda t: t in ("Paris", "Lyon", "Nice")),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
     lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_json": PERSON}, lambda t: _person(t)),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
     lambda t: _person(t) and " " not in t.replace('", "', "").split('"name"')[0]),
])
def test_vllm_spellings(client, extra, check):
    resp = client.completions.create(model="smol", prompt="The answer:", max_tokens=60,
                                     temperature=0, extra_body=extra)
    assert resp.choices[0].finish_reason == "stop"
    assert check(resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
])
def test_bad_grammar_or_refused_field_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smol", messages=ASK, max_tokens=5, extra_body=extra)
    assert info.value.body["param"] == param


def test_unknown_fields_are_named_in_a_header(client):
    raw = client.chat.completions.with_raw_response.create(
        model="smol", messages=ASK, max_tokens=2, extra_body={"store": True, "metadata": {}})
    assert raw.headers["x-deepserve-ignored-fields"] == "metadata, store"
    plain = client.chat.completions.with_raw_response.create(model="smol", messages=ASK,
                                                             max_tokens=2)
    assert "x-deepserve-ignored-fields" not in plain.headers


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_tool_choice_calls_it_with_valid_arguments(client):
    resp = client.chat.completions.create(
        model="smol", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_required_tool_choice_streams_calls(client):
    chunks = list(client.chat.completions.create(
        model="smol", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=60,
        tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or []]
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finish == ["tool_calls"]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert isinstance(json.loads(args)["city"], str)


def _wait_metric(node, name: str, ok, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = _metrics(node).get((name, ()), 0.0)
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


def test_a_turn_that_ends_in_tool_calls_keeps_its_kv_in_host_memory(node, client, model_dir):
    """The reply ends in a tool call: its turn is pinned in the host tier. Other
    prompts then push it out of the device pool and flood the host tier (the
    pressure: the next turn's lookup reaches the host tier, counted there), and
    the turn with the tool's result still finds its whole prompt cached."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hits = _wait_metric(node, "deepserve_turn_pin_hit_blocks_total", lambda v: True, 0)
    first = client.chat.completions.create(
        model="smol", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=60,
        tool_choice="required", parallel_tool_calls=False)
    assert first.choices[0].finish_reason == "tool_calls"
    assert _wait_metric(node, "deepserve_turn_pins", lambda v: v >= 1) >= 1  # pinned
    for i in range(4):  # about 3,600 tokens: past the device pool and the host tier
        words = " ".join(f"item{i}x{j}" for j in range(400))
        prompt = tok.decode(tok(words)["input_ids"][:900])
        client.completions.create(model="smol", prompt=prompt, max_tokens=1)
    call = first.choices[0].message.tool_calls[0]
    second = client.chat.completions.create(
        model="smol", tools=[WEATHER], temperature=0, max_tokens=4, messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 23 degrees"}])
    now = _wait_metric(node, "deepserve_turn_pin_hit_blocks_total", lambda v: v > hits)
    assert now - hits >= first.usage.prompt_tokens // 16 - 1  # from the host tier
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens // 16 - 1) * 16, (cached, first.usage)


def test_tool_history_renders_on_a_template_without_tools(client):
    """SmolLM2's template knows no tools: the gateway renders them (and the
    history's call and result) as Hermes text; the answer uses the result."""
    resp = client.chat.completions.create(
        model="smol", tools=[WEATHER], temperature=0, max_tokens=30, messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 23 degrees"}])
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 100  # the tools' system prompt is in


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(client, mode):
    instructor = pytest.importorskip("instructor")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    person = patched.chat.completions.create(
        model="smol", response_model=Person, temperature=0, max_tokens=60, max_retries=0,
        messages=[{"role": "user", "content": "Ann is 31 years old. Extract her."}])
    assert isinstance(person, Person) and isinstance(person.age, int) and person.name


def _hf_loglikelihoods(model_dir: Path, texts: list[tuple[str, str]]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for context, continuation in texts:
        ctx = tok(context)["input_ids"]
        whole = tok(context + continuation)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
        out.append(sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole))))
    return out


PAIRS = [("The capital of France is", " Paris"), ("One, two, three,", " four five")]


def test_echo_logprobs_of_a_list_of_prompts_equal_transformers(client, model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok(c + x)["input_ids"] for c, x in PAIRS]
    resp = client.completions.create(model="smol", prompt=prompts, max_tokens=1, temperature=0,
                                     logprobs=1, echo=True)
    assert [c.index for c in resp.choices] == [0, 1]
    for (context, _), ids, choice, want in zip(PAIRS, prompts, resp.choices,
                                              _hf_loglikelihoods(model_dir, PAIRS)):
        lps = choice.logprobs.token_logprobs
        assert lps[0] is None and len(lps) == len(ids) + 1
        # the first prompt token is shown as text too, though it has no logprob
        assert choice.logprobs.tokens[:len(ids)] == [tok.decode([i]) for i in ids]
        assert choice.text.startswith(tok.decode(ids))
        ctxlen = len(tok(context)["input_ids"])
        assert abs(sum(lps[ctxlen:-1]) - want) < 1e-3
    assert resp.usage.prompt_tokens == sum(len(i) for i in prompts)


def test_prompt_logprobs_field(client, model_dir):
    """max_tokens past 1: the TE schedules a step ahead of the first token
    (a reply of one token never did, and hid a bug that lost them)."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(model_dir))("Hello there, friend")["input_ids"]
    resp = client.completions.create(model="smol", prompt="Hello there, friend", max_tokens=4,
                                     temperature=0, extra_body={"prompt_logprobs": 2})
    body = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(body) == len(ids) and body[0] is None
    assert all(str(i) in entry and len(entry) >= 2 for i, entry in zip(ids[1:], body[1:]))


def test_lm_eval_local_completions_loglikelihood(node, model_dir, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": x}) + "\n"
                            for c, x in PAIRS))
    (tmp_path / "tiny_ll.yaml").write_text(
        "task: tiny_ll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n"
        "    higher_is_better: false\n")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_ll"], log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"base_url": f"{node.url}/v1/completions", "model": "smol",
                    "tokenizer": str(model_dir), "tokenizer_backend": "huggingface",
                    "num_concurrent": 1, "max_retries": 1, "batch_size": 2})
    samples = sorted(results["samples"]["tiny_ll"], key=lambda s: s["doc_id"])
    got = [float(s["resps"][0][0][0]) for s in samples]
    for value, want in zip(got, _hf_loglikelihoods(model_dir, PAIRS), strict=True):
        assert abs(value - want) < 1e-3
