"""Health, auth and tenants, admission (429 / 503), deadlines, disconnects, metrics."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepserve.gateway.http import generation
from tests.gateway.conftest import MODEL
from tests.gateway.fake_backend import CACHED_TOKENS, FakeBackend

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


def _is_error_body(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


def test_health_follows_te_list(make_stack, monkeypatch):
    stack = make_stack()
    with stack.http() as http:
        assert http.get("/health").json() == {"status": "ok", "num_tes": 1}
        stack.backend.te_ids = []
        assert stack.backend.wait_for(lambda: http.get("/health").status_code == 503)
        assert _is_error_body(http.get("/health").json())
        monkeypatch.setattr(generation, "NO_ENGINE_WAIT_S", 0.3)  # no TE came back in time
        with pytest.raises(openai.InternalServerError) as info:
            stack.openai().completions.create(model=MODEL, prompt="no te")
        assert info.value.status_code == 503 and info.value.code == "no_engine_available"
        monkeypatch.setattr(generation, "NO_ENGINE_WAIT_S", 10.0)
        # every TE down (restarting): a request waits for one instead of 503
        # (found by the chaos tool: 747 refusals while both TEs restarted at once)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(http.post, "/v1/completions",
                                  json={"model": MODEL, "prompt": "wait", "max_tokens": 2})
            time.sleep(0.5)
            assert not waiting.done()
            stack.backend.te_ids = ["te-0"]
            assert waiting.result(timeout=10).status_code == 200
        stack.backend.te_ids = ["te-0", "te-1"]
        assert stack.backend.wait_for(
            lambda: http.get("/health").json() == {"status": "ok", "num_tes": 2})


def test_a_gateway_that_has_not_heard_the_cm_yet_waits_for_it_instead_of_503(make_stack):
    """Found by the chaos run: a restarted gateway answered 503 "no engine" to
    every request until the CM's next TE list, while the node's TEs served."""
    stack = make_stack(healthy=False, backend_type=lambda je, cm: FakeBackend(
        je, cm, first_publish_s=1.5))
    with stack.http() as http:
        assert http.get("/health").status_code == 503  # no TE list yet: not healthy
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "early",
                                                   "max_tokens": 2})
        assert resp.status_code == 200, resp.text  # it waited for the first TE list
        assert resp.json()["usage"]["completion_tokens"] == 2


def test_tenants_get_their_own_salt(make_stack):
    stack = make_stack(api_keys=KEYS)
    a, b = stack.openai(api_key="key-a"), stack.openai(api_key="key-b")
    kwargs = dict(model=MODEL, prompt="shared prompt", max_tokens=1, user="tenant-b")
    first_a = a.completions.create(**kwargs)
    first_b = b.completions.create(**kwargs)
    second_a = a.completions.create(**kwargs)
    assert [s.salt for s in stack.backend.submits_for(first_a.id)] == ["tenant-a"]
    assert [s.salt for s in stack.backend.submits_for(first_b.id)] == ["tenant-b"]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first_a, first_b, second_a)]
    assert cached == [0, 0, CACHED_TOKENS]  # b never hits a's prefix


def test_bad_or_missing_key_is_401(make_stack):
    stack = make_stack(api_keys=KEYS)
    with pytest.raises(openai.AuthenticationError) as info:
        stack.openai(api_key="key-c").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        stack.openai(api_key="key-c").models.list()
    with stack.http() as http:
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 401 and _is_error_body(resp.json())
        assert http.get("/health").status_code == 200  # health needs no key


def test_too_many_open_requests_is_429(make_stack):
    stack = make_stack(max_open_requests=2)
    client = stack.openai()
    results = []

    def slow_request():
        results.append(client.completions.create(model=MODEL, prompt="[slow]", max_tokens=4))

    threads = [threading.Thread(target=slow_request) for _ in range(2)]
    for t in threads:
        t.start()
    assert stack.backend.wait_for(lambda: len(stack.backend.submits) == 2)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=MODEL, prompt="one too many", max_tokens=1)
    assert info.value.status_code == 429
    for t in threads:
        t.join(10.0)
    assert [r.choices[0].finish_reason for r in results] == ["length", "length"]
    with pytest.raises(openai.RateLimitError):  # n counts n
        client.completions.create(model=MODEL, prompt="n=3", max_tokens=1, n=3)
    client.completions.create(model=MODEL, prompt="room again", max_tokens=1, n=2)


def test_a_flooding_tenant_cannot_shut_another_out(make_stack):
    """max_open_requests = 4, tenant a holds all 4: a's next request is a 429,
    b's is served (b is under its equal share, 4 / 2); once b holds 2, b's
    next is refused too (its share reached, the gateway over its cap)."""
    stack = make_stack(max_open_requests=4, api_keys=KEYS)
    a, b = stack.openai(api_key="key-a"), stack.openai(api_key="key-b")
    done = []

    def slow(client, n=1):
        done.append(client.completions.create(model=MODEL, prompt="[slow]", max_tokens=4, n=n))

    threads = [threading.Thread(target=slow, args=(a, 2)) for _ in range(2)]
    for t in threads:
        t.start()
    assert stack.backend.wait_for(lambda: len(stack.backend.submits) == 4)
    with pytest.raises(openai.RateLimitError):
        a.completions.create(model=MODEL, prompt="a again", max_tokens=1)  # at the cap, a's share
    threads.append(threading.Thread(target=slow, args=(b, 2)))  # b: 0 + 2 <= 4 / 2
    threads[-1].start()
    assert stack.backend.wait_for(lambda: len(stack.backend.submits) == 6)
    with pytest.raises(openai.RateLimitError):
        b.completions.create(model=MODEL, prompt="b past its share", max_tokens=1)
    for t in threads:
        t.join(10.0)
    assert len(done) == 3 and all(c.finish_reason == "length" for r in done for c in r.choices)


@pytest.fixture(scope="module")
def short_deadline():
    from tests.gateway.conftest import running_stack
    with running_stack(request_timeout_s=0.5) as stack:
        yield stack


@pytest.mark.parametrize("magic", ["[mute]", "[hang]"])
def test_deadline_non_stream(short_deadline, magic):
    stack = short_deadline
    with pytest.raises(openai.APIStatusError) as info:
        stack.openai().completions.create(model=MODEL, prompt=magic, max_tokens=5)
    assert info.value.status_code == 504 and info.value.code == "request_timeout"
    [submit] = [s for s in stack.backend.submits if s.prompt == magic][-1:]
    assert stack.backend.wait_for(lambda: submit.request_id in stack.backend.aborts)


def test_deadline_mid_stream_ends_with_error_event(short_deadline):
    stack = short_deadline
    with stack.http() as http:
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "[hang] stream", "max_tokens": 5, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert _is_error_body(error) and error["error"]["code"] == "request_timeout"
    request_id = json.loads(events[0])["id"] + "-0"
    assert stack.backend.wait_for(lambda: request_id in stack.backend.aborts)
    with pytest.raises(openai.APIError):  # the openai client raises on the error event
        list(stack.openai().completions.create(model=MODEL, prompt="[hang] 2", stream=True))


def test_disconnect_mid_stream_aborts(stack):
    with stack.http() as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "[slow] bye"}],
                "max_tokens": 50, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            next(line for line in lines if line.startswith("data: "))  # one real delta
    request_id = json.loads(first[6:])["id"] + "-0"
    assert stack.backend.wait_for(lambda: request_id in stack.backend.aborts, timeout_s=3.0)


def test_disconnect_while_waiting_non_stream_aborts(stack):
    with stack.http(timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": MODEL, "prompt": "[slow] gone",
                                           "max_tokens": 50})
    [submit] = [s for s in stack.backend.submits if s.prompt == "[slow] gone"]
    assert stack.backend.wait_for(lambda: submit.request_id in stack.backend.aborts,
                                  timeout_s=3.0)


def test_metrics(stack):
    client = stack.openai()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}],
                                   max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with stack.http() as http:
        resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    requests = {(s.labels["endpoint"], s.labels["status"]): s.value
                for s in families["deepserve_gateway_requests"].samples
                if s.name.endswith("_total")}
    assert requests[("/v1/chat/completions", "200")] >= 1
    assert requests[("/v1/completions", "404")] >= 1
    ttft = families["deepserve_gateway_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    count = [s.value for s in ttft.samples if s.name.endswith("_count")]
    assert count and count[0] >= 1
    assert "deepserve_gateway_time_per_output_token_seconds" in families
    kv = {s.labels["te_id"]: s.value for s in families["deepserve_te_kv_usage"].samples}
    assert kv == {"te-0": 0.25}
    assert "deepserve_te_prefix_cache_hit_rate" in families
    assert {"deepserve_gateway_requests_running", "deepserve_gateway_requests_waiting"} <= set(
        families)
