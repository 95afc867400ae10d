"""Tenant limits through the real gateway and a real job executor
(je_backend.py: one fake TE that holds every task): exactly at a limit is
served, one past it is answered 429 with an OpenAI error and Retry-After."""

from __future__ import annotations

import threading
import time

import pytest

from deepserve.config.tenants import TenantSection, TenantsSection
from tests.gateway.conftest import running_stack
from tests.gateway.je_backend import JEBackend

KEYS = {"key-a": "a", "key-b": "b"}


@pytest.fixture(scope="module")
def je_stack(tiny_model):
    class Backend(JEBackend):
        model_dir = tiny_model
        tenants = TenantsSection(retry_after_s=2, named={
            "a": TenantSection(max_requests=2), "b": TenantSection(max_tokens=20)})

    with running_stack(backend_type=Backend, api_keys=KEYS, request_timeout_s=4.0) as s:
        yield s


def _post(stack, key: str, prompt, max_tokens: int = 6):
    with stack.http() as http:
        return http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "tiny-test", "prompt": prompt, "max_tokens": max_tokens})


def _held(stack, key: str, prompt, n: int, num_held: int) -> list[threading.Thread]:
    """n requests the fake TE holds (each ends 504 at the deadline), sent and held."""
    threads = [threading.Thread(target=_post, args=(stack, key, prompt), daemon=True)
               for _ in range(n)]
    for t in threads:
        t.start()
    deadline_ok = _wait(lambda: len(stack.backend.submits) >= num_held)
    assert deadline_ok, f"the TE holds {len(stack.backend.submits)} tasks, not {num_held}"
    return threads


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def _assert_429(response, limit: str):
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "2"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert limit in error["message"]


def test_max_requests_at_the_limit_is_served_one_more_is_429(je_stack):
    threads = _held(je_stack, "key-a", "hello", 2, 2)  # exactly max_requests = 2: both run
    _assert_429(_post(je_stack, "key-a", "hello"), "max_requests 2")
    for t in threads:
        t.join(10.0)
    # their deadline ended them (504, aborted, TaskDone): the tenant has room again
    assert _wait(lambda: _post(je_stack, "key-a", "[x]", max_tokens=1).status_code != 429)


def test_max_tokens_at_the_limit_is_served_one_more_is_429(je_stack):
    before = len(je_stack.backend.submits)
    ids = [11, 12, 13, 14]  # 4 prompt tokens + max_tokens 6 = 10 tokens each
    threads = _held(je_stack, "key-b", ids, 2, before + 2)  # exactly 20 = max_tokens
    _assert_429(_post(je_stack, "key-b", [11], max_tokens=1), "max_tokens 20")
    assert _post(je_stack, "key-a", "other tenant", max_tokens=1).status_code != 429
    for t in threads:
        t.join(10.0)
