"""The OpenAI endpoints through the real `openai` client, against the fake backend."""

from __future__ import annotations

import time
import uuid

import openai
import pytest

from tests.gateway.conftest import MODEL
from tests.gateway.fake_backend import CACHED_TOKENS, TOKEN_BASE, WORDS

CHAT = [{"role": "user", "content": "hi"}]
CHAT_PROMPT_TOKENS = len(b"user: hi")


def _unique(text: str = "prompt") -> str:
    return f"{text} {uuid.uuid4().hex}"


def _stream_text(chunks, index: int = 0) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_chat_completion(stack):
    resp = stack.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.id.startswith("chatcmpl-")
    [choice] = resp.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and len(choice.message.content.split()) == 5
    assert resp.usage.prompt_tokens == CHAT_PROMPT_TOKENS
    assert resp.usage.completion_tokens == 5 and resp.usage.total_tokens == CHAT_PROMPT_TOKENS + 5


def test_chat_stream_matches_non_stream(stack):
    client = stack.openai()
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=6, seed=7)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _stream_text(chunks) == (full, "length")
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens == CHAT_PROMPT_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_and_not(stack):
    client = stack.openai()
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=4, seed=3)
    resp = client.completions.create(**kwargs)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(b"hello") and resp.usage.completion_tokens == 4
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert _stream_text(chunks) == (resp.choices[0].text, "length")
    assert all(c.usage is None for c in chunks)  # include_usage not asked


@pytest.mark.parametrize("prompt", [[104, 105], ["hello"], [[104, 105]]])
def test_completion_prompt_forms(stack, prompt):
    resp = stack.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    expected = 5 if prompt == ["hello"] else 2
    assert resp.usage.prompt_tokens == expected


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(stack, stream):
    client = stack.openai()
    kwargs = dict(model=MODEL, prompt="stop test", max_tokens=8, seed=11)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.split()[3]
    expected = full[:full.find(stop)]
    if stream:
        text, finish = _stream_text(client.completions.create(**kwargs, stop=[stop], stream=True))
    else:
        choice = client.completions.create(**kwargs, stop=stop).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert (text, finish) == (expected, "stop")
    assert stop not in text


def test_seed_reproducible(stack):
    client = stack.openai()
    texts = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, seed=s)
             .choices[0].message.content for s in (5, 5, 6)]
    assert texts[0] == texts[1] != texts[2]


def test_usage_cached_tokens_on_repeat(stack):
    client = stack.openai()
    prompt = _unique()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    assert second.usage.prompt_tokens == len(prompt.encode())


def test_n_choices(stack):
    resp = stack.openai().completions.create(model=MODEL, prompt="n test", max_tokens=5, n=2,
                                             seed=40)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.choices[0].text != resp.choices[1].text
    assert resp.usage.completion_tokens == 10
    seeds = sorted(s.sampling.seed for s in stack.backend.submits_for(resp.id))
    assert seeds == [40, 41]


def test_n_choices_stream(stack):
    chunks = list(stack.openai().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, n=2, seed=1, stream=True))
    for index in (0, 1):
        text, finish = _stream_text(chunks, index)
        assert finish == "length" and len(text.split()) == 3


def test_chat_logprobs(stack):
    resp = stack.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                  logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(entry.token for entry in content) == resp.choices[0].message.content
    for entry in content:  # the token's text and bytes, from the TE's token_bytes
        assert bytes(entry.bytes).decode() == entry.token and entry.token.strip() in WORDS
        assert entry.logprob == -0.25 and len(entry.top_logprobs) == 2
        top = entry.top_logprobs[1]  # the fake's first alternative: id TOKEN_BASE, " alpha"
        if entry.token.strip() != "alpha":  # (else the sampled token's own bytes)
            assert (top.token, bytes(top.bytes)) == (" alpha", b" alpha")


def test_completion_logprobs_stream(stack):
    chunks = list(stack.openai().completions.create(model=MODEL, prompt="lp", max_tokens=3,
                                                    logprobs=1, stream=True))
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    text, _ = _stream_text(chunks)
    assert len(tokens) == 3 and "".join(tokens) == text


def test_completion_logprobs_offsets_and_token_ids(stack):
    kwargs = dict(model=MODEL, prompt="lp", max_tokens=4, logprobs=2, seed=5)
    resp = stack.openai().completions.create(**kwargs)
    logprobs, text = resp.choices[0].logprobs, resp.choices[0].text
    assert [text[o:] for o in logprobs.text_offset] == [
        "".join(logprobs.tokens[i:]) for i in range(4)]
    assert all(" alpha" in top for top, token in zip(logprobs.top_logprobs, logprobs.tokens)
               if token.strip() != "alpha")  # the fake's first alternative (id TOKEN_BASE)
    as_ids = stack.openai().completions.create(
        **kwargs, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(t.startswith("token_id:") and int(t[9:]) >= TOKEN_BASE for t in as_ids.tokens)
    assert as_ids.text_offset == logprobs.text_offset


def test_no_logprobs_unless_asked(stack):
    resp = stack.openai().completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert resp.choices[0].logprobs is None


def test_models(stack):
    assert [m.id for m in stack.openai().models.list()] == [MODEL]
    assert stack.openai().models.retrieve(MODEL).id == MODEL


def test_unknown_model_is_404(stack):
    with pytest.raises(openai.NotFoundError) as info:
        stack.openai().chat.completions.create(model="gpt-nope", messages=CHAT)
    assert info.value.status_code == 404 and info.value.code == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long_is_400(stack, stream):
    too_long = "x" * (stack.backend.max_prompt_tokens + 1)  # the TE's limit
    with pytest.raises(openai.BadRequestError) as info:
        stack.openai().completions.create(model=MODEL, prompt=too_long, stream=stream)
    assert info.value.code == "context_length_exceeded"


def test_prompt_over_gateway_guard_never_reaches_backend(stack):
    marker = _unique("guard")
    with pytest.raises(openai.BadRequestError) as info:
        stack.openai().chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": marker + "x" * stack.config.max_prompt_chars}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert not [s for s in stack.backend.submits if marker in str(s.messages)]


@pytest.mark.parametrize("magic, error, status", [("[invalid]", openai.BadRequestError, 400),
                                                  ("[dead]", openai.InternalServerError, 503)])
def test_backend_failures(stack, magic, error, status):
    for stream in (False, True):
        with pytest.raises(error) as info:
            stack.openai().completions.create(model=MODEL, prompt=magic, stream=stream)
        assert info.value.status_code == status


def test_user_field_never_changes_salt(stack):
    resp = stack.openai().completions.create(model=MODEL, prompt="salt", max_tokens=1,
                                             user="mallory")
    assert [s.salt for s in stack.backend.submits_for(resp.id)] == ["default"]


def test_openapi_schema(stack):
    with stack.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(paths)


def test_completed_requests_report_their_latencies_to_the_job_executor(make_stack):
    """The autoscaler's SLO samples: TTFT (and TPOT past one token) per model."""
    s = make_stack()
    client = s.openai()
    client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    deadline = time.monotonic() + 5
    while not s.backend.latencies and time.monotonic() < deadline:
        time.sleep(0.05)
    [msg] = s.backend.latencies
    [(ttft_ms, tpot_ms)] = msg.samples[MODEL]
    assert 0 < ttft_ms < 5000 and (tpot_ms is None or tpot_ms >= 0)
