"""Who reads which tenant's series on /metrics: with api_keys, a key sees the
per-tenant series (label `tenant`) of its own tenant only and every other
series whole; a key in admin_keys, or anyone on a node without api_keys, sees
every tenant's. An admin key must be one of api_keys."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.metrics import GatewayMetrics
from deepserve.messages.engine import RequestDelta, RequestFailed
from tests.gateway.conftest import MODEL

KEYS = {"sk-a": "tenant-alpha", "sk-b": "tenant-beta", "sk-ops": "operators"}
TENANT_FAMILIES = {"deepserve_tenant_requests_queued", "deepserve_tenant_requests_in_flight",
                   "deepserve_tenant_requests_admitted", "deepserve_tenant_requests_rejected",
                   "deepserve_tenant_queue_wait_seconds"}


def _traffic(metrics: GatewayMetrics, tenant: str) -> None:
    metrics.observe_admission(tenant, RequestDelta(request_id="r", text="", token_ids=[],
                                                    queued_s=0.2))
    metrics.observe_admission(tenant, RequestFailed(request_id="s", error="rate_limited",
                                                    message="", retry_after_s=1))


def _tenants_in(text: str) -> set[str]:
    """Every tenant label value of the exposition's samples."""
    return {s.labels["tenant"] for f in text_string_to_metric_families(text)
            for s in f.samples if "tenant" in s.labels}


@pytest.fixture(scope="module")
def keyed(request):
    """Two tenants with traffic (sk-a, sk-b) and an admin key (sk-ops)."""
    from tests.gateway.conftest import running_stack
    with running_stack(api_keys=KEYS, admin_keys=("sk-ops",)) as stack:
        for key in ("sk-a", "sk-b"):
            done = stack.openai(api_key=key).completions.create(model=MODEL, prompt="hi",
                                                               max_tokens=2)
            assert done.choices[0].text
        yield stack


def _scrape(stack, key: str | None = None) -> str:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with stack.http() as http:
        resp = http.get("/metrics", headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.text


def test_a_key_sees_its_own_tenant_and_no_other_tenant_name(keyed):
    for key, own, other in (("sk-a", "tenant-alpha", "tenant-beta"),
                            ("sk-b", "tenant-beta", "tenant-alpha")):
        text = _scrape(keyed, key)
        assert _tenants_in(text) == {own}
        assert other not in text and "operators" not in text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert TENANT_FAMILIES <= set(families)  # HELP / TYPE of every tenant family stay
        wait = families["deepserve_tenant_queue_wait_seconds"]
        names = {s.name for s in wait.samples}  # the histogram whole, for its tenant
        assert {"deepserve_tenant_queue_wait_seconds_bucket",
                "deepserve_tenant_queue_wait_seconds_sum",
                "deepserve_tenant_queue_wait_seconds_count"} <= names
        admitted = {s.labels["tenant"]: s.value
                    for s in families["deepserve_tenant_requests_admitted"].samples
                    if s.name.endswith("_total")}
        assert admitted == {own: 1.0}
        # every series without a tenant label is still there
        assert "deepserve_gateway_requests_total{" in text and "deepserve_te_kv_usage{" in text


def test_an_admin_key_sees_every_tenant(keyed):
    text = _scrape(keyed, "sk-ops")
    assert {"tenant-alpha", "tenant-beta"} <= _tenants_in(text)


def test_a_bad_key_is_still_401(keyed):
    with keyed.http() as http:
        for headers in ({}, {"authorization": "Bearer sk-nope"}):
            assert http.get("/metrics", headers=headers).status_code == 401


def test_an_open_node_shows_every_tenant(make_stack):
    stack = make_stack()
    metrics = stack.server.config.app.state.gateway.metrics
    for tenant in ("tenant-alpha", "tenant-beta"):  # no keys: the HTTP API has one tenant
        _traffic(metrics, tenant)
    stack.openai().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert _tenants_in(_scrape(stack)) >= {"tenant-alpha", "tenant-beta", "default"}


def test_render_of_one_tenant_is_the_whole_less_the_others_lines():
    """Line for line: HELP / TYPE and every untenanted series kept, a histogram's
    _bucket / _sum / _count / _created of another tenant dropped."""
    metrics = GatewayMetrics()
    metrics.count_request("/v1/completions", 200)
    for tenant in ("a", "b"):
        _traffic(metrics, tenant)
    metrics.refresh_tenants([("a", True), ("b", False)])
    whole = metrics.render().decode().splitlines()
    only_a = metrics.render("a").decode().splitlines()
    assert only_a == [line for line in whole if 'tenant="b"' not in line]
    assert any('tenant="a"' in line for line in only_a)
    assert any(line.startswith("deepserve_tenant_queue_wait_seconds_bucket{") and
               'tenant="b"' in line for line in whole)
    assert metrics.render("c").decode().count('tenant="') == 0


def test_an_admin_key_must_be_an_api_key():
    addrs = dict(je_address="ipc:///tmp/je", cm_address="ipc:///tmp/cm",
                 reply_address="ipc:///tmp/reply")
    with pytest.raises(ValueError, match="admin_keys: entry 2 is not a key of api_keys") as info:
        GatewayConfig(api_keys={"sk-a": "a"}, admin_keys=("sk-a", "sk-secret"), **addrs)
    assert "sk-secret" not in str(info.value)  # a key is a secret: named by its position
    assert GatewayConfig(api_keys={"sk-a": "a"}, admin_keys=["sk-a"], **addrs).admin_keys == (
        "sk-a",)
