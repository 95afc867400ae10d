"""The gateway sends only the sampling fields a client set: the TE fills the
rest from the model (messages/sampling.py). Every field it accepts reaches the
JE as given, and a bad value is a 400 naming the field."""

from __future__ import annotations

import json
import uuid

import pytest

from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.http.schemas import MAX_NUM_STOP_TOKEN_IDS, MAX_TOKEN_ID
from tests.gateway.conftest import MODEL
from tests.gateway.fake_backend import FakeBackend

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
UNSET = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")


def _body(path: str, **fields) -> dict:
    text = f"hi {uuid.uuid4().hex}"  # finds its own submits among the shared stack's
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}
    return {"model": MODEL, "prompt": text, **fields}


def _submits(stack, body: dict) -> list:
    text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
    return [s for s in stack.backend.submits
            if text in (s.prompt or "") or any(text in m["content"] for m in s.messages or [])]


def _post(http, path: str, body: dict) -> list[dict]:
    """The choices of a response, streamed or not: [{index, finish_reason, text}]."""
    if not body.get("stream"):
        resp = http.post(path, json=body)
        assert resp.status_code == 200, resp.text
        return [{"index": c["index"], "finish_reason": c["finish_reason"],
                 "text": c["message"]["content"] if path == CHAT else c["text"]}
                for c in resp.json()["choices"]]
    choices: dict[int, dict] = {}
    with http.stream("POST", path, json=body) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                got = choices.setdefault(c["index"], {"index": c["index"], "text": "",
                                                      "finish_reason": None})
                got["text"] += (c["delta"].get("content") or "") if path == CHAT else c["text"]
                got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
    return [choices[i] for i in sorted(choices)]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_omitted_fields_travel_unset_and_take_the_models_default(stack, path, stream):
    body = _body(path, n=2, stream=stream)
    with stack.http() as http:
        choices = _post(http, path, body)
    submits = _submits(stack, body)
    assert len(submits) == 2
    for s in submits:
        assert all(getattr(s.sampling, f) is None for f in UNSET), s.sampling
    # the fake TE resolves an unset max_tokens to its model's max_new_tokens
    assert [(c["finish_reason"], len(c["text"].split())) for c in choices] == \
        [("length", FakeBackend.model_max_tokens)] * 2


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_every_field_the_client_sets_reaches_the_je_as_set(stack, path):
    limit = "max_completion_tokens" if path == CHAT else "max_tokens"
    body = _body(path, temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                 stop_token_ids=[7, 0], ignore_eos=True, **{limit: 3})
    with stack.http() as http:
        [choice] = _post(http, path, body)
    [submit] = _submits(stack, body)
    s = submit.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens) == (
        1.0, 1.0, -1, 1.0, 3)  # equal to the built-in defaults, and still set: they win
    assert (s.stop_token_ids, s.ignore_eos) == ([7, 0], True)
    assert len(choice["text"].split()) == 3


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0), ("repetition_penalty", -1.2), ("repetition_penalty", "1.1"),
    ("top_k", -2), ("top_k", 2.5), ("temperature", 3), ("max_tokens", 0),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["1"]), ("stop_token_ids", 5),
    ("stop_token_ids", [2**31]), ("stop_token_ids", [1] * (MAX_NUM_STOP_TOKEN_IDS + 1)),
    ("ignore_eos", "true"), ("ignore_eos", 1)])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_bad_value_is_a_400_naming_the_field(stack, path, field, value):
    with stack.http() as http:
        resp = http.post(path, json=_body(path, **{field: value}))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_token_ids_are_accepted_up_to_their_bounds(stack, path):
    body = _body(path, max_tokens=2, stop_token_ids=[MAX_TOKEN_ID] + [0] * (
        MAX_NUM_STOP_TOKEN_IDS - 1), ignore_eos=False)
    with stack.http() as http:
        _post(http, path, body)
    [submit] = _submits(stack, body)
    assert len(submit.sampling.stop_token_ids) == MAX_NUM_STOP_TOKEN_IDS
    assert submit.sampling.stop_token_ids[0] == MAX_TOKEN_ID  # the TE checks the vocabulary
    assert submit.sampling.ignore_eos is False


def test_an_operator_default_max_tokens_fills_an_omitted_one(make_stack):
    stack = make_stack(default_max_tokens=4)
    with stack.http() as http:
        body = _body(COMPLETIONS)
        [choice] = _post(http, COMPLETIONS, body)
        own = _body(COMPLETIONS, max_tokens=6)
        _post(http, COMPLETIONS, own)
    assert _submits(stack, body)[0].sampling.max_tokens == 4
    assert len(choice["text"].split()) == 4
    assert _submits(stack, own)[0].sampling.max_tokens == 6  # the client's own wins


def test_default_max_tokens_is_unset_unless_the_operator_sets_it():
    addresses = dict(je_address="ipc://a", cm_address="ipc://b", reply_address="ipc://c")
    assert GatewayConfig(**addresses).default_max_tokens is None
    with pytest.raises(ValueError, match="default_max_tokens"):
        GatewayConfig(**addresses, default_max_tokens=0)
