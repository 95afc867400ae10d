"""The API describes itself: /openapi.json declares every request body,
response model and status; unsupported methods are 405 with `Allow`; with
api_keys the description and /metrics need a key; engine failures reach the
tenant as public messages, never naming a TE."""

from __future__ import annotations

import logging

import pytest

from deepserve.gateway.errors import APIError
from deepserve.gateway.http.openapi import ROUTE_ERRORS
from tests.gateway.conftest import MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ADMIN = ("/metrics", "/openapi.json", "/docs", "/redoc")
_ERROR_BODY = {"$ref": "#/components/schemas/ErrorBody"}


def _doc(stack, **headers) -> dict:
    with stack.http() as http:
        resp = http.get("/openapi.json", headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_generation_routes_declare_body_models_and_every_status(stack):
    doc = _doc(stack)
    for path, request, response in ((CHAT, "ChatCompletionRequest", "ChatCompletion"),
                                    (COMPLETIONS, "CompletionRequest", "Completion")):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{request}"}
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert "text/event-stream" in ok
        statuses = set(op["responses"]) - {"200"}
        assert statuses == {"400", "404", "413", "429", "500", "503", "504"}  # no 422, no 401
        for status in statuses:
            assert op["responses"][status]["content"]["application/json"]["schema"] == _ERROR_BODY
        assert doc["components"]["schemas"][request]["properties"]["model"]["enum"] == [MODEL]
        assert "security" not in op
    assert set(doc["components"]["schemas"]["ErrorDetail"]["required"]) == {
        "message", "type", "param", "code"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_every_route_is_documented(stack):
    doc = _doc(stack)
    assert set(doc["paths"]) == set(ROUTE_ERRORS)
    for path, operations in doc["paths"].items():
        for op in operations.values():
            assert "200" in op["responses"] and "422" not in op["responses"], path
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_served_responses_match_the_declared_models(stack):
    from deepserve.gateway.http import openapi as models
    with stack.http() as http:
        chat = http.post(CHAT, json={"model": MODEL, "max_tokens": 3, "logprobs": True,
                                     "top_logprobs": 2,
                                     "messages": [{"role": "user", "content": "hi"}]})
        done = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                            "logprobs": 2})
        listed = http.get("/v1/models")
        missing = http.get("/v1/models/nope")
    models.ChatCompletion.model_validate(chat.json(), strict=True)
    models.Completion.model_validate(done.json(), strict=True)
    models.ModelList.model_validate(listed.json(), strict=True)
    assert missing.status_code == 404
    models.ErrorBody.model_validate(missing.json(), strict=True)


@pytest.mark.parametrize("method, path, allowed", [
    ("TRACE", "/health", {"GET"}), ("POST", "/v1/models", {"GET"}),
    ("GET", COMPLETIONS, {"POST"}), ("DELETE", CHAT, {"POST"}),
    ("PUT", "/v1/models/x", {"GET"})])
def test_unsupported_method_is_405_with_allow(stack, method, path, allowed):
    with stack.http() as http:
        resp = http.request(method, path)
    assert resp.status_code == 405
    assert {m.strip() for m in resp.headers["allow"].split(",")} == allowed
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_without_keys_the_admin_pages_are_open(stack):
    with stack.http() as http:
        for path in ADMIN:
            assert http.get(path).status_code == 200, path


@pytest.fixture(scope="module")
def keyed(request):
    from tests.gateway.conftest import running_stack
    with running_stack(api_keys={"sk-good": "tenant"}) as stack:
        yield stack


def test_with_keys_metrics_and_the_description_need_a_key(keyed):
    with keyed.http() as http:
        for path in ADMIN:
            for headers in ({}, {"authorization": "Bearer sk-bad"}):
                resp = http.get(path, headers=headers)
                assert resp.status_code == 401, (path, headers)
                assert resp.json()["error"]["code"] == "invalid_api_key"
            assert http.get(path, headers={"authorization": "Bearer sk-good"}).status_code == 200
        assert http.get("/health").status_code == 200  # probes stay anonymous


def test_with_keys_every_operation_but_health_declares_401(keyed):
    doc = _doc(keyed, authorization="Bearer sk-good")
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http",
                                                               "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        for op in operations.values():
            keyed_op = path != "/health"
            assert ("401" in op["responses"]) == keyed_op, path
            assert (op.get("security") == [{"bearer": []}]) == keyed_op, path


@pytest.mark.parametrize("error, status", [
    ("engine_dead", 503), ("te_lost", 503), ("kv_transfer_failed", 503),
    ("request_crashed_engine", 500), ("something_new", 500)])
def test_engine_failures_are_public_messages(caplog, error, status):
    detail = "TE te0 went down while serving the request (attempt 2 of 3) on 10.0.0.7"
    with caplog.at_level(logging.WARNING, logger="deepserve.gateway.errors"):
        err = APIError.from_failure(error, detail, param="prompt")
    assert err.status == status and err.param is None
    assert "te0" not in err.message and "TE " not in err.message and "10.0" not in err.message
    assert detail in caplog.text  # the detail stays in the gateway's log


def test_request_errors_keep_their_message():
    err = APIError.from_failure("prompt_too_long", "prompt has 9000 tokens", "prompt")
    assert (err.status, err.message, err.param) == (400, "prompt has 9000 tokens", "prompt")


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_engine_is_not_named_to_the_tenant(stack, stream):
    with stack.http() as http:
        resp = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "[dead]", "stream": stream})
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert err["code"] == "engine_dead" and "te-0" not in resp.text and "TE" not in err["message"]


def test_integral_floats_are_integers_and_any_integer_is_a_seed(stack):
    with stack.http() as http:
        resp = http.post(COMPLETIONS, json={"model": MODEL, "prompt": [5.0, 6], "n": 2.0,
                                            "max_tokens": 2.0, "seed": 2**64 + 3})
    assert resp.status_code == 200, resp.text
    submits = stack.backend.submits_for(resp.json()["id"])
    assert [s.sampling.seed for s in submits] == [3, 4]  # 2**64 + 3 wraps into int64
    assert submits[0].prompt_token_ids == [5, 6] and submits[0].sampling.max_tokens == 2


@pytest.mark.parametrize("renderer_type", ["chat", "completion"])
def test_logprobs_are_always_finite_json_numbers(renderer_type):
    import json

    from deepserve.gateway.http.chat_response import ChatRenderer
    from deepserve.gateway.http.responses import (LOGPROB_FLOOR, Choice, CompletionRenderer,
                                                  Usage)
    from deepserve.messages.engine import RequestDelta
    inf, nan = float("inf"), float("nan")
    delta = RequestDelta(request_id="r", text="a", token_ids=[1], finish_reason="length",
                         logprobs=[(1, -inf, [(1, -inf), (2, nan)])])
    cls = ChatRenderer if renderer_type == "chat" else CompletionRenderer
    renderer = cls("id", MODEL, with_logprobs=True, include_usage=False)
    choice = Choice(0)
    choice.add(delta)
    whole = json.dumps(renderer.response([choice], Usage(1)), allow_nan=False)
    first_chunk = json.dumps(renderer.delta_chunks(0, delta)[0], allow_nan=False)
    assert whole.count(str(LOGPROB_FLOOR)) == first_chunk.count(str(LOGPROB_FLOOR)) == 3
