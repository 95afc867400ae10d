"""conf/grafana/deepserve.json against the metrics the gateway's /metrics exports.

Every metric a panel (or a template variable) queries must be exported by
GatewayMetrics, and every deepserve_ metric the gateway exports must be shown by
some panel, so the dashboard stays complete when metrics are added.

dashboard_metric_names(path) is also used by end-to-end tests to check the
names against a live /metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepserve.gateway.metrics import GatewayMetrics, RequestTiming
from deepserve.messages.cache import TierReport
from deepserve.messages.control import TEInfo, TEReport
from deepserve.messages.engine import RequestDelta, RequestFailed
from deepserve.messages.scaling import ScaleEvent

DASHBOARD = Path(__file__).resolve().parents[2] / "conf" / "grafana" / "deepserve.json"

NOT_SHOWN: dict[str, str] = {}
"""Exported deepserve_ metric families intentionally without a panel: name -> reason."""

PROMETHEUS_LABELS = {"job", "instance"}
"""Labels Prometheus adds to every scraped series."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_METRIC = re.compile(r"(?<![A-Za-z0-9_:$])deepserve_[A-Za-z0-9_:]*")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def expr_metric_names(expr: str) -> set[str]:
    """The deepserve_ metric names a PromQL expression selects (string literals ignored)."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def _panels(dashboard: dict) -> list[dict]:
    """Every panel, those nested in collapsed rows included."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _queries(dashboard: dict) -> list[str]:
    """The PromQL of every panel target and every query template variable."""
    exprs = [t.get("expr", "") for p in _panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        exprs.append(query.get("query", "") if isinstance(query, dict) else query or "")
        exprs.append(var.get("definition", ""))
    return exprs


def dashboard_metric_names(path: str | Path = DASHBOARD) -> set[str]:
    """Every deepserve_ metric (sample) name the dashboard's queries select,
    e.g. deepserve_gateway_requests_total, deepserve_scale_stage_seconds_bucket."""
    dashboard = json.loads(Path(path).read_text())
    names: set[str] = set()
    for expr in _queries(dashboard):
        names |= expr_metric_names(expr)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def families():
    """The metric families of a gateway's /metrics with one sample of every labelled metric."""
    metrics = GatewayMetrics()
    metrics.count_request("/v1/chat/completions", 200)
    metrics.observe_request(RequestTiming(submitted_at=0.0, first_token_at=0.2,
                                          finished_at=1.0, num_tokens=5))
    report = TEReport(te_id="m-0", num_waiting=1, num_running=2, load_tokens=30, kv_usage=0.5,
                      num_prompt_tokens=100, num_cached_tokens=40, kv_transfer_bytes=4096,
                      kv_transfer_seconds=[0.01], tier_hit_tokens={"host": 16, "disk": 16},
                      tier_fetch_seconds={"host": [0.002], "disk": [0.01]},
                      kv_cached_bytes=1 << 20, cost_model={"prefill_tokens_per_s": 500.0},
                      storage_queue_tokens=64, storage_read_bytes={"prefill": 10, "decode": 20},
                      read_paths={"prefill": 1, "decode": 2},
                      tier_lookups={"fetch": 3, "no_room": 1})
    metrics.observe_te_report(report)
    metrics.observe_tiers(TierReport(host_bytes=1 << 20, disk_bytes=1 << 22, num_contexts=1),
                          {"m-0": report})
    metrics.observe_scale_event(ScaleEvent(model="m", te_id="m-0", direction="out",
                                           source="cold", stages={"te_load": 0.1}))
    metrics.refresh(num_running=2, num_waiting=1, te_ids=["m-0"], reports={"m-0": report})
    metrics.refresh_models(["m"], [TEInfo(te_id="m-0", model="m", address="ipc://m-0")])
    metrics.observe_admission("a", RequestDelta(request_id="r", text="", token_ids=[],
                                                 queued_s=0.5))
    metrics.observe_admission("a", RequestFailed(request_id="s", error="rate_limited",
                                                 message="", retry_after_s=1))
    metrics.refresh_tenants([("a", True), ("a", False)])
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())
            if f.name.startswith("deepserve_")}


def _is_created(name: str, families) -> bool:
    """X_created: prometheus_client's creation time of counter / histogram X, no metric."""
    return name.endswith("_created") and name.removesuffix("_created") in families


def _sample_labels(families) -> dict[str, set[str]]:
    """Exported sample name -> its label names."""
    out: dict[str, set[str]] = {}
    for family in families.values():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_dashboard_is_grafana_json(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] and dashboard["title"]
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    model = variables["model"]
    assert model["type"] == "query"
    assert model["definition"] == "label_values(deepserve_model_tes, model)"
    assert model["query"]["query"] == model["definition"]
    assert model["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_panels_are_well_formed(dashboard):
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "TEs & cache", "Scaling", "KV transfer",
                    "KV cache tiers", "DualPath storage reads", "Tenants"]
    for panel in panels:
        assert panel["title"], panel
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert all(ref_ids) and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_panels_do_not_overlap(dashboard):
    boxes = [(p["title"], p["gridPos"]) for p in dashboard["panels"]]
    for title, g in boxes:
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, title
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1:]:
            apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                     or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
            assert apart, f"{a!r} overlaps {b!r}"


def test_expr_metric_names():
    assert expr_metric_names(
        'histogram_quantile(0.5, sum by (le) (rate(deepserve_a_bucket[5m]))) / '
        'deepserve_b{x="deepserve_not_a_metric"} + sum(deepserve_c) + $deepserve_var') == {
            "deepserve_a_bucket", "deepserve_b", "deepserve_c"}


def test_dashboard_queries_only_exported_metrics(families):
    exported = set(_sample_labels(families))
    used = dashboard_metric_names()
    assert used, "the dashboard queries no deepserve_ metric"
    assert used <= exported, f"not exported by the gateway: {sorted(used - exported)}"


def test_every_exported_metric_has_a_panel(families):
    used = dashboard_metric_names()
    missing = {name for name, family in families.items()
               if not used & ({name} | {s.name for s in family.samples})
               and not _is_created(name, families)}
    assert missing <= set(NOT_SHOWN), f"exported but in no panel: {sorted(missing)}"
    assert not set(NOT_SHOWN) - set(families), "NOT_SHOWN names a metric no longer exported"


def test_labels_exist(dashboard, families):
    """Labels in selectors, by/without and {{legends}} exist on the metrics queried."""
    labels_of = _sample_labels(families)
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            known = set(PROMETHEUS_LABELS)
            for name in expr_metric_names(expr):
                known |= labels_of.get(name, set())
            stripped = _STRING.sub('""', expr)
            used = set(_MATCHER.findall(" ".join(_SELECTOR.findall(stripped))))
            for group in _GROUPING.findall(stripped):
                used |= {label.strip() for label in group.split(",") if label.strip()}
            used |= set(_LEGEND.findall(target.get("legendFormat", "")))
            assert used <= known, f"{panel['title']}: unknown labels {used - known} in {expr}"


def test_quantiles_read_buckets(dashboard):
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            if "histogram_quantile" in expr:
                names = expr_metric_names(expr)
                assert names and all(n.endswith("_bucket") for n in names), expr
                assert re.search(r"by \((?:[^)]*\b)?le\b", expr), expr
