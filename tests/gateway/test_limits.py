"""Early refusals: an oversized body is a 413 before parsing and before auth;
too many messages or too long a stop string is a 400 naming the field."""

from __future__ import annotations

import json
import time

import pytest

from deepserve.gateway.http.schemas import MAX_NUM_MESSAGES, MAX_STOP_CHARS
from tests.gateway.conftest import MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LIMIT = 4096


def _good_chat(content: str = "hi") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def _assert_error(resp, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code
    return err


@pytest.fixture(scope="module")
def limited(request):
    from tests.gateway.conftest import running_stack
    with running_stack(max_body_bytes=LIMIT, api_keys={"sk-good": "tenant"}) as stack:
        yield stack


def _auth() -> dict:
    return {"authorization": "Bearer sk-good"}


def test_body_at_the_limit_is_served(limited):
    body = json.dumps(_good_chat()).encode()
    body += b" " * (LIMIT - len(body))  # trailing whitespace is still valid JSON
    assert len(body) == LIMIT
    with limited.http() as http:
        resp = http.post(CHAT, content=body, headers={**_auth(), "content-type": "application/json"})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_oversized_body_is_413_before_auth_and_parsing(limited, path):
    """No key and a body that is not even JSON: 413, not 401 or 400."""
    with limited.http() as http:
        resp = http.post(path, content=b"{" * (LIMIT + 1),
                         headers={"content-type": "application/json"})
        _assert_error(resp, 413, code="request_too_large")
        resp = http.post(path, content=b"{" * (LIMIT + 1), headers=_auth())
        _assert_error(resp, 413, code="request_too_large")
        # the gateway still serves afterwards
        assert http.post(CHAT, json=_good_chat(), headers=_auth()).status_code == 200


def test_chunked_oversized_body_is_413(limited):
    """No Content-Length: the guard counts the bytes as they are read."""
    body = json.dumps(_good_chat("x" * (2 * LIMIT))).encode()

    def chunks():
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    with limited.http() as http:
        resp = http.post(CHAT, content=chunks(),
                         headers={**_auth(), "content-type": "application/json"})
        assert "content-length" not in {k.lower() for k in resp.request.headers}
        _assert_error(resp, 413, code="request_too_large")
        assert http.post(CHAT, json=_good_chat(), headers=_auth()).status_code == 200


def test_413_is_counted_in_metrics(limited):
    requests = limited.server.config.app.state.gateway.metrics.requests
    counted = requests.labels(endpoint=COMPLETIONS, status="413")
    before = counted._value.get()
    with limited.http() as http:
        _assert_error(http.post(COMPLETIONS, content=b"x" * (LIMIT + 1), headers=_auth()), 413,
                      code="request_too_large")
    deadline = time.monotonic() + 2.0  # counted once the answer is sent: just after
    while counted._value.get() != before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counted._value.get() == before + 1


def test_too_many_messages_is_400_naming_messages(stack):
    messages = [{"role": "user", "content": "m"}] * (MAX_NUM_MESSAGES + 1)
    with stack.http() as http:
        resp = http.post(CHAT, json={**_good_chat(), "messages": messages})
        _assert_error(resp, 400, param="messages")
        resp = http.post(CHAT, json={**_good_chat(), "messages": messages[:MAX_NUM_MESSAGES]})
        # accepted by the gateway (the fake TE may still find the prompt too long)
        assert resp.status_code == 200 or resp.json()["error"]["param"] != "messages", resp.text


@pytest.mark.parametrize("path, base", [
    (CHAT, _good_chat()), (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 2})])
@pytest.mark.parametrize("stop", ["s" * (MAX_STOP_CHARS + 1), ["ok", "s" * (MAX_STOP_CHARS + 1)]])
def test_too_long_stop_string_is_400_naming_stop(stack, path, base, stop):
    with stack.http() as http:
        _assert_error(http.post(path, json={**base, "stop": stop}), 400, param="stop")
        ok = "s" * MAX_STOP_CHARS if isinstance(stop, str) else ["ok", "s" * MAX_STOP_CHARS]
        assert http.post(path, json={**base, "stop": ok}).status_code == 200
