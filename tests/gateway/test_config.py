"""GatewayConfig, request-body conversion, and the package's import boundary."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from pydantic import ValidationError

from deepserve.errors import InvalidRequestError
from deepserve.gateway.config import GatewayConfig, parse_api_keys
from deepserve.gateway.errors import APIError
from deepserve.gateway.http.prompt_list import MAX_PROMPTS
from deepserve.gateway.http.schemas import INT64_MAX, ChatCompletionRequest, CompletionRequest

ADDRS = dict(je_address="ipc:///tmp/je", cm_address="ipc:///tmp/cm",
             reply_address="ipc:///tmp/reply")


def test_api_keys_from_env_and_kwargs():
    env = {"DEEPSERVE_API_KEYS": "k1:tenantA, k2:tenantB,"}
    config = GatewayConfig.from_env(env, api_keys={"k3": "tenantC"}, **ADDRS)
    assert dict(config.api_keys) == {"k1": "tenantA", "k2": "tenantB", "k3": "tenantC"}
    assert config.has_auth and not GatewayConfig.from_env({}, **ADDRS).has_auth
    with pytest.raises(TypeError):
        config.api_keys["k4"] = "x"  # frozen, keys included


@pytest.mark.parametrize("text", ["nocolon", ":tenant", "key:"])
def test_api_keys_malformed(text):
    with pytest.raises(ValueError, match="KEY:TENANT"):
        parse_api_keys(text)


@pytest.mark.parametrize("field, value", [("max_open_requests", 0), ("request_timeout_s", 0),
                                          ("port", 70000), ("je_address", ""),
                                          ("max_prompt_chars", 0)])
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        GatewayConfig(**{**ADDRS, field: value})


def test_from_env_rejects_unknown_fields():
    with pytest.raises(ValueError, match="colour"):
        GatewayConfig.from_env({}, colour="blue", **ADDRS)


def test_chat_sampling():
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
        "max_tokens": 9, "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5,
        "stop": "END", "seed": INT64_MAX, "n": 2, "logprobs": True, "top_logprobs": 3,
        "some_future_field": {"x": 1}})
    first, second = body.sampling_per_choice(default_max_tokens=16)
    assert (first.max_tokens, first.temperature, first.top_p, first.stop, first.logprobs) == (
        5, 0.0, 0.5, ["END"], 3)
    assert (first.seed, second.seed) == (INT64_MAX, -(2**63))  # seed + 1 wraps in int64
    assert body.wire_messages(max_chars=10) == [{"role": "user", "content": "ab"}]
    with pytest.raises(APIError) as info:
        body.wire_messages(max_chars=1)
    assert info.value.code == "context_length_exceeded"


def test_completion_defaults_and_prompt_forms():
    body = CompletionRequest.model_validate({"model": "m", "prompt": ["hello"]})
    [sampling] = body.sampling_per_choice(default_max_tokens=7)
    assert (sampling.max_tokens, sampling.temperature, sampling.logprobs) == (7, None, None)
    [unset] = body.sampling_per_choice(default_max_tokens=None)  # the TE resolves them
    assert unset.max_tokens is None and not unset.is_resolved
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(unset)) == {}  # nothing on the wire
    assert body.wire_prompts(100) == [("hello", None)]
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]], "logprobs": 0})
    assert ids.wire_prompts(100) == [(None, [1, 2])]
    assert ids.sampling(16).logprobs == 0
    two = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})
    assert two.wire_prompts(100) == [("a", None), ("b", None)]
    CompletionRequest.model_validate({"model": "m", "prompt": ["a"] * MAX_PROMPTS})
    with pytest.raises(ValidationError, match=f"at most {MAX_PROMPTS} items"):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a"] * (MAX_PROMPTS + 1)})


def test_sampling_validation_is_invalid_request():
    # past the model's own checks (it refuses "" too): SamplingParams.validate still does
    body = CompletionRequest.model_construct(model="m", prompt="x", stop=[""])
    with pytest.raises(InvalidRequestError) as info:
        body.sampling(16)
    assert info.value.param == "stop"


def test_gateway_imports_only_lower_floors():
    code = ("import sys, deepserve.gateway, deepserve.gateway.__main__; "
            "bad = [m for m in sys.modules if m.split('.')[:2] in (['deepserve', 'engine'], "
            "['deepserve', 'worker'], ['deepserve', 'model'], ['deepserve', 'control']) "
            "or m == 'torch']; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
