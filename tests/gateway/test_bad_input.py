"""Bad input never reaches a 5xx: a property test over both POST endpoints,
with good requests running beside it; plus fixed odd cases."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GOOD = {CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 2}}
HUGE = "x" * 100_001  # past the shared stack's max_prompt_chars
_COMMON_BAD = {
    "model": [None, 1, [], {}, "", "other-model", "\ud800"],
    "max_tokens": [0, -1, 1.5, "5", True, 2**31, 10**30, -(10**30), [], {}],
    "temperature": [-0.1, 2.5, "hot", True, [], 10**400],
    "top_p": [0, 0.0, 1.01, -1, "x", True],
    "top_k": [-2, 1.5, "5", True, 2**31, []],
    "repetition_penalty": [0, 0.0, -1.5, "x", True, 10**400, []],
    "seed": [1.5, "1", True],  # any integer is a seed (wrapped into int64)
    "stop": ["", [""], [1], 5, ["a"] * 17, {"a": 1}, "\ud800"],
    "n": [0, 9, -1, 1.5, "2", True],
    "stream": ["yes", 1, []],
    "stream_options": ["x", {"include_usage": "yes"}, 1],
    "user": [1, [], {}],
}
BAD = {
    CHAT: {**_COMMON_BAD,
           "messages": [[], None, "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}],
                        [{"role": "user", "content": 5}], [{"role": "user", "content": "\udfff"}],
                        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                        [{"role": "user", "content": HUGE}], [1, 2]],
           "max_completion_tokens": [0, -5, "1", 1.5],
           "logprobs": ["yes", 1, 2, []],
           "top_logprobs": [-1, 21, "1", 1.5]},
    COMPLETIONS: {**_COMMON_BAD,
                  "prompt": ["", [], [""], ["a", ""], ["a"] * 65, [-1], [2**40], [1.5], [True],
                             [[1], []], [[]], None, 5, {"a": 1}, HUGE, "\ud800"],
                  "logprobs": [-1, 21, "1", 1.5, True]},
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)


@st.composite
def one_bad_field(draw, path: str) -> bytes:
    """A good body with one field set to a bad value (or removed, if required),
    plus unknown extra fields, which must be ignored."""
    body = dict(GOOD[path])
    field = draw(st.sampled_from(sorted(BAD[path]) + ["<drop model>", "<drop input>"]))
    if field == "<drop model>":
        del body["model"]
    elif field == "<drop input>":
        del body["messages" if path == CHAT else "prompt"]
    else:
        body[field] = draw(st.sampled_from(BAD[path][field]))
    extras = draw(st.dictionaries(st.text(min_size=1, max_size=8).map(lambda s: "x_" + s),
                                  json_values, max_size=3))
    return json.dumps({**extras, **body}).encode()


def raw_bodies(path: str):
    good = json.dumps(GOOD[path]).encode()
    return st.one_of(
        one_bad_field(path),
        st.binary(max_size=64),                                            # anything at all
        st.integers(1, len(good) - 1).map(lambda k: good[:k]),             # truncated JSON
        json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
        st.binary(min_size=1, max_size=8).map(                             # invalid UTF-8
            lambda b: good.replace(b'"hi"', b'"hi\xff' + b.replace(b'"', b"") + b'"')),
    )


def _check_error(resp) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


def _good_requests(stack, num: int, results: list, stop: threading.Event) -> None:
    client = stack.openai()
    for i in range(num):
        if i % 2:
            chunks = list(client.completions.create(model=MODEL, prompt="good", max_tokens=3,
                                                    stream=True))
            results.append(chunks[-1].choices[0].finish_reason)
        else:
            resp = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "good"}], max_tokens=3)
            results.append(resp.choices[0].finish_reason)
        stop.wait(0.05)


def test_bad_input_never_5xx(stack):
    results: list = []
    stop = threading.Event()
    worker = threading.Thread(target=_good_requests, args=(stack, 10, results, stop))
    worker.start()
    with stack.http() as http:
        @settings(max_examples=250, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(path=st.sampled_from([CHAT, COMPLETIONS]), data=st.data())
        def run(path, data):
            body = data.draw(raw_bodies(path))
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
            _check_error(resp)

        try:
            run()
        finally:
            worker.join(20.0)
        assert not worker.is_alive()
        assert results == ["length"] * 10
        assert http.get("/health").status_code == 200
        assert http.post(CHAT, json=GOOD[CHAT]).status_code == 200


@pytest.mark.parametrize("method, path, kwargs, status", [
    ("POST", COMPLETIONS, {"content": b""}, 400),
    ("POST", COMPLETIONS, {"content": b"[" * 100_000}, 400),
    ("POST", COMPLETIONS, {"content": b'{"model": 1e999999}'}, 400),
    ("POST", CHAT, {"content": json.dumps(GOOD[CHAT]).encode(),
                    "headers": {"content-type": "text/plain"}}, 400),
    ("POST", CHAT, {"content": b'{"model": "tiny-test", "messages": NaN}'}, 400),
    ("POST", CHAT, {"json": {**GOOD[CHAT], "top_logprobs": 2}}, 400),  # needs logprobs
    ("GET", COMPLETIONS, {}, 405),
    ("GET", "/v1/nothing-here", {}, 404),
    ("GET", "/v1/models/other", {}, 404),
])
def test_odd_requests(stack, method, path, kwargs, status):
    with stack.http() as http:
        resp = http.request(method, path, **kwargs)
    assert resp.status_code == status
    _check_error(resp)
