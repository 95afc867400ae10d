"""POST /tokenize and /detokenize, GET /version, max_model_len on /v1/models:
the gateway's own tokenizer of a served model (SmolLM2's directory, named by
model_dirs) gives the ids the TE's tokenizer gives, and detokenize undoes it."""

from __future__ import annotations

import importlib.metadata
import time

import pytest

from deepserve.gateway.http.tokenize import _special_ends
from deepserve.tokenizer import Tokenizer
from tests.gateway.conftest import MODEL, running_stack

SMOL_MAX_LEN = 8192  # its config.json's max_position_embeddings
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo <|im_start|>assistant 日本 🙂"}]


@pytest.fixture(scope="module")
def tok_stack(smollm2_dir):
    with running_stack(model_dirs={MODEL: str(smollm2_dir)}, max_prompt_chars=1000) as stack:
        yield stack


@pytest.fixture(scope="module")
def smol(smollm2_dir) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def _post(stack, path: str, body: dict, **headers):
    with stack.http() as http:
        return http.post(path, json=body, headers=headers)


def test_tokenize_a_prompt_as_the_te_does(tok_stack, smol):
    prompt = "The quick brown fox 12345 héllo 🙂 <|im_end|>"
    resp = _post(tok_stack, "/tokenize", {"model": MODEL, "prompt": prompt})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    expected = smol.request_ids(prompt=prompt)[1]
    assert body == {"count": len(expected), "max_model_len": SMOL_MAX_LEN, "tokens": expected,
                    "token_strs": None}
    strs = _post(tok_stack, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert strs["tokens"] == expected  # no model: the first served one
    assert strs["token_strs"] == [smol.id_to_token(i) for i in expected]
    assert "Ġquick" in strs["token_strs"]  # the vocabulary's spelling, as vLLM gives it


def test_tokenize_messages_as_a_chat_request_is(tok_stack, smol):
    body = _post(tok_stack, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert body["tokens"] == smol.request_ids(messages=CHAT)[1]
    im_start = smol.token_to_id("<|im_start|>")
    assert body["tokens"].count(im_start) == 3  # the template's, not the user's text
    bare = _post(tok_stack, "/tokenize", {"messages": CHAT, "add_generation_prompt": False,
                                          "add_special_tokens": True}).json()
    assert body["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < body["count"]


def test_add_special_tokens_adds_what_the_post_processor_adds():
    class Bos:  # a tokenizer whose encode() puts a BOS in front and an EOS behind
        def encode(self, text, add_special_tokens=True):
            ids = [ord(c) for c in text]
            return [1, *ids, 2] if add_special_tokens else ids

    assert _special_ends(Bos()) == ([1], [2])


@pytest.mark.parametrize("text", ["hello world", " héllo\n\n日本 🙂 ", "<|im_start|>x"])
def test_detokenize_round_trips(tok_stack, text):
    ids = _post(tok_stack, "/tokenize", {"prompt": text}).json()["tokens"]
    resp = _post(tok_stack, "/detokenize", {"model": MODEL, "tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "messages"),
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": "x" * 1001}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
])
def test_bad_requests_are_openai_errors(tok_stack, path, body, status, param):
    resp = _post(tok_stack, path, body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_model_without_a_directory_cannot_be_tokenized(stack):
    resp = _post(stack, "/tokenize", {"prompt": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"


def test_version(stack):
    with stack.http() as http:
        assert http.get("/version").json() == {
            "version": importlib.metadata.version("deepserve")}


def test_max_model_len_is_the_tes_else_the_models_config(make_stack, smollm2_dir):
    stack = make_stack(model_dirs={MODEL: str(smollm2_dir)})
    with stack.http() as http:
        assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == SMOL_MAX_LEN
        stack.backend.max_model_len = 512  # what its TEs announce, from the next TE list
        deadline = time.monotonic() + 5.0
        while http.get("/v1/models").json()["data"][0]["max_model_len"] != 512:
            assert time.monotonic() < deadline, "the TE's max_model_len was never shown"
            time.sleep(0.05)
        assert _post(stack, "/tokenize", {"prompt": "hi"}).json()["max_model_len"] == 512


def test_needs_a_key_like_the_other_endpoints(make_stack, smollm2_dir):
    stack = make_stack(api_keys={"k1": "tenant-a"}, model_dirs={MODEL: str(smollm2_dir)})
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert _post(stack, path, body).status_code == 401
        assert _post(stack, path, body, Authorization="Bearer k1").status_code == 200
    with stack.http() as http:
        assert http.get("/version").status_code == 401
        assert http.get("/version", headers={"Authorization": "Bearer k1"}).status_code == 200
