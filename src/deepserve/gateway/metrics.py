"""Prometheus metrics of one gateway, in their own CollectorRegistry.

Request counts are taken by an ASGI middleware (every answer, errors
included); latencies by the reply streams when a sub-request ends; gauges of
open requests and of each TE (from the CM's TEReports) are refreshed when
/metrics is scraped, so a TE that left the TE list leaves the output too.
render(tenant) leaves out the other tenants' series (label `tenant`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from deepserve.messages.cache import TierReport
from deepserve.messages.control import TEInfo, TEReport
from deepserve.messages.engine import RequestDelta, RequestFailed
from deepserve.messages.scaling import ScaleEvent

CONTENT_TYPE = CONTENT_TYPE_LATEST
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
_STAGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5)


@dataclass
class RequestTiming:
    """time.monotonic() stamps of one sub-request (None: not reached)."""

    submitted_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    num_tokens: int = 0


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("deepserve_gateway_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("deepserve_gateway_time_to_first_token_seconds",
                              "Seconds from submission to the first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("deepserve_gateway_time_per_output_token_seconds",
                              "Seconds per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("deepserve_gateway_e2e_request_latency_seconds",
                             "Seconds from submission to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.late_tokens = Counter("deepserve_gateway_late_tokens", "Tokens of an attempt a "
                                   "sub-request had left behind (generated again by the "
                                   "current one), dropped", registry=r)
        self.late_requests = Counter("deepserve_gateway_late_requests", "Sub-requests that "
                                     "got late tokens: generated on two TEs at once",
                                     registry=r)
        self.running = Gauge("deepserve_gateway_requests_running",
                             "Sub-requests that have received their first reply", registry=r)
        self.waiting = Gauge("deepserve_gateway_requests_waiting",
                             "Sub-requests submitted and still without a reply", registry=r)
        self.num_tes = Gauge("deepserve_gateway_tes", "TEs in the cluster manager's TE list",
                             registry=r)
        self.model_tes = Gauge("deepserve_model_tes", "TEs of each served model in the TE list",
                               ["model"], registry=r)
        self.scale_events = Counter("deepserve_scale_events", "TEs added (out) or removed (in) "
                                    "by scaling, by how they came up (source)",
                                    ["model", "direction", "source"], registry=r)
        self.scale_stage = Histogram("deepserve_scale_stage_seconds", "Seconds of each stage "
                                     "of a scale-out (messages/scaling.py STAGES)", ["stage"],
                                     buckets=_STAGE_BUCKETS, registry=r)
        self.te_kv_usage = Gauge("deepserve_te_kv_usage", "Fraction of KV blocks in use",
                                 ["te_id"], registry=r)
        self.te_prefix_hit_rate = Gauge(
            "deepserve_te_prefix_cache_hit_rate",
            "Cached prompt tokens / prompt tokens, cumulative", ["te_id"], registry=r)
        self.te_running = Gauge("deepserve_te_requests_running", "Requests running on the TE",
                                ["te_id"], registry=r)
        self.te_waiting = Gauge("deepserve_te_requests_waiting", "Requests queued on the TE",
                                ["te_id"], registry=r)
        self.kv_transfer_bytes = Counter(
            "deepserve_kv_transfer_bytes", "KV bytes prefill TEs sent to decode TEs (DistFlow)",
            ["te_id"], registry=r)
        self.kv_transfer_seconds = Histogram(
            "deepserve_kv_transfer_seconds", "Seconds to send one request's KV to its decode TE",
            buckets=_TPOT_BUCKETS + (5.0, 10.0, 30.0), registry=r)
        self.cache_hit_tokens = Counter(
            "deepserve_cache_hit_tokens", "Prompt tokens served from the KV cache instead of "
            "computed, by the tier they came from (device, host, disk; stream: a decode "
            "TE's layer stream, DualPath)", ["tier"], registry=r)
        self.cache_bytes = Gauge("deepserve_cache_bytes", "Bytes of KV blocks held, per tier "
                                 "(device: all TEs' prefix trees)", ["tier"], registry=r)
        self.cache_fetch_seconds = Histogram(
            "deepserve_cache_fetch_seconds", "Seconds to bring one request's cached blocks up "
            "from a tier to a TE's device pool", ["tier"], buckets=_TPOT_BUCKETS + (5.0,),
            registry=r)
        self.contexts = Gauge("deepserve_contexts", "Live contexts (POST /v1/contexts)",
                              registry=r)
        self.pinned_bytes = Gauge("deepserve_contexts_pinned_bytes", "Bytes of KV blocks the "
                                  "live contexts pin in the host / disk tiers", registry=r)
        self.turn_pins = Gauge("deepserve_turn_pins", "Chat turns that ended in tool calls "
                               "whose KV the host tier holds now", registry=r)
        self.turn_pin_hits = Counter("deepserve_turn_pin_hit_blocks_total", "KV blocks found "
                                     "in the host tier while a turn pin held them", registry=r)
        self.turn_pins_refused = Counter("deepserve_turn_pins_refused_total", "Turn pins "
                                         "past the host tier's budget for them", registry=r)
        self.te_cost_model = Gauge(
            "deepserve_te_cost_model", "A TE's fetch-or-recompute cost model (tiers/cost_model.py): "
            "prefill_tokens_per_s, {host,disk}_bandwidth (bytes/s), {host,disk}_latency_ms",
            ["te_id", "param"], registry=r)
        self.storage_read_bytes = Counter(
            "deepserve_storage_read_bytes", "KV bytes a TE read from the disk tier (its storage "
            "NIC), by DualPath's read path: prefill (for itself) or decode (for its prefill TE)",
            ["te_id", "path"], registry=r)
        self.dualpath_decisions = Counter(
            "deepserve_dualpath_decisions", "DualPath's read-path choices, counted by the decode "
            "TEs that took the tasks: prefill (the prefill TE reads its hits) or decode (the "
            "decode TE stages them for it)", ["path"], registry=r)
        self.tier_lookups = Counter(
            "deepserve_tier_lookups", "A TE's lookups below its device pool for a new "
            "request's prefix, by outcome: fetch, none (no tier holds it), recompute (the "
            "cost model's choice), no_room (no device blocks to load it into now: it waits for "
            "them and looks again), no_room_read_ahead (no_room, and its disk hits are read "
            "into the TE's buffer meanwhile), room_timeout (waited too long: computed), gap, "
            "timeout (the tier service did not answer in time), fetch_layers (a fetch loaded layer by "
            "layer), layers_lost (such a load failed in its forward: the request was retried)",
            ["outcome"], registry=r)
        self.storage_queue = Gauge("deepserve_storage_read_queue_tokens", "Tokens of KV a TE "
                                   "still has to read from the disk tier", ["te_id"], registry=r)
        self.tenant_queued = Gauge(
            "deepserve_tenant_requests_queued", "Sub-requests sent and not answered yet: "
            "waiting in the job executor's fair queue (or being prefilled)", ["tenant"],
            registry=r)
        self.tenant_in_flight = Gauge("deepserve_tenant_requests_in_flight",
                                      "Sub-requests streaming their output", ["tenant"],
                                      registry=r)
        self.tenant_admitted = Counter("deepserve_tenant_requests_admitted", "Sub-requests "
                                       "the job executor took (not refused)", ["tenant"],
                                       registry=r)
        self.tenant_rejected = Counter("deepserve_tenant_requests_rejected", "Sub-requests "
                                       "refused for a tenant limit (HTTP 429)", ["tenant"],
                                       registry=r)
        self.tenant_queue_wait = Histogram(
            "deepserve_tenant_queue_wait_seconds", "Seconds a sub-request waited in the job "
            "executor's fair queue for a free TE slot", ["tenant"],
            buckets=(0.0, 0.01, 0.05) + _STAGE_BUCKETS[3:] + (60.0, 120.0), registry=r)
        self._hits_seen: dict[tuple[str, str], int] = {}
        self._reads_seen: dict[tuple[str, str], int] = {}
        self._decisions_seen: dict[tuple[str, str], int] = {}
        self._lookups_seen: dict[tuple[str, str], int] = {}
        self._tiers_seen: dict[str, int] = {}  # the tier service's cumulative counts

    def count_request(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_request(self, timing: RequestTiming) -> None:
        """One finished sub-request; an aborted one without tokens counts only e2e."""
        if timing.finished_at is None:
            return
        self.e2e.observe(timing.finished_at - timing.submitted_at)
        if timing.first_token_at is None:
            return
        self.ttft.observe(timing.first_token_at - timing.submitted_at)
        if timing.num_tokens > 1:
            self.tpot.observe((timing.finished_at - timing.first_token_at)
                              / (timing.num_tokens - 1))

    def observe_admission(self, tenant: str | None, first: RequestDelta | RequestFailed) -> None:
        """A sub-request's first reply: refused for its tenant's limit, or taken
        (a delta: with its wait in the job executor's fair queue)."""
        tenant = tenant or "default"
        if isinstance(first, RequestFailed):
            if first.error == "rate_limited":
                self.tenant_rejected.labels(tenant=tenant).inc()
            return
        self.tenant_admitted.labels(tenant=tenant).inc()
        self.tenant_queue_wait.labels(tenant=tenant).observe(first.queued_s)

    def refresh_tenants(self, open_requests: Iterable[tuple[str | None, bool]]) -> None:
        """Queued / in-flight gauges per tenant from (tenant, started) of each
        open sub-request; a tenant with none shows 0 once it has been seen."""
        for gauge in (self.tenant_queued, self.tenant_in_flight):
            for labels in list(gauge._metrics):
                gauge.labels(*labels).set(0)
        for tenant, is_started in open_requests:
            gauge = self.tenant_in_flight if is_started else self.tenant_queued
            gauge.labels(tenant=tenant or "default").inc()

    def observe_te_report(self, report: TEReport) -> None:
        """Counters a TEReport carries as increments since the previous one."""
        if report.kv_transfer_bytes:
            self.kv_transfer_bytes.labels(te_id=report.te_id).inc(report.kv_transfer_bytes)
        for seconds in report.kv_transfer_seconds:
            self.kv_transfer_seconds.observe(seconds)
        for tier, values in report.tier_fetch_seconds.items():
            for seconds in values:
                self.cache_fetch_seconds.labels(tier=tier).observe(seconds)
        below = sum(v for t, v in report.tier_hit_tokens.items() if t != "device")
        totals = {"device": max(0, report.num_cached_tokens - below), **report.tier_hit_tokens}
        # (a TE with tiers reports its own device hits: a decode task's are its peer's)
        for tier, total in totals.items():  # cumulative per TE: count what is new
            self.cache_hit_tokens.labels(tier=tier).inc(
                _new(self._hits_seen, (report.te_id, tier), total))
        for path, total in report.storage_read_bytes.items():
            self.storage_read_bytes.labels(te_id=report.te_id, path=path).inc(
                _new(self._reads_seen, (report.te_id, path), total))
        for path, total in report.read_paths.items():
            self.dualpath_decisions.labels(path=path).inc(
                _new(self._decisions_seen, (report.te_id, path), total))
        for outcome, total in report.tier_lookups.items():
            self.tier_lookups.labels(outcome=outcome).inc(
                _new(self._lookups_seen, (report.te_id, outcome), total))

    def observe_tiers(self, tiers: TierReport | None, reports: Mapping[str, TEReport]) -> None:
        """deepserve_cache_bytes per tier and live contexts, when /metrics is scraped."""
        self.cache_bytes.labels(tier="device").set(sum(r.kv_cached_bytes
                                                       for r in reports.values()))
        self.cache_bytes.labels(tier="host").set(tiers.host_bytes if tiers else 0)
        self.cache_bytes.labels(tier="disk").set(tiers.disk_bytes if tiers else 0)
        self.contexts.set(tiers.num_contexts if tiers else 0)
        self.pinned_bytes.set(tiers.pinned_bytes if tiers else 0)
        self.turn_pins.set(tiers.num_turn_pins if tiers else 0)
        if tiers is not None:
            self.turn_pin_hits.inc(_new(self._tiers_seen, "hits", tiers.turn_pin_hits))
            self.turn_pins_refused.inc(_new(self._tiers_seen, "refused",
                                            tiers.turn_pins_refused))

    def observe_scale_event(self, event: ScaleEvent) -> None:
        self.scale_events.labels(model=event.model, direction=event.direction,
                                 source=event.source or "none").inc()
        for stage, seconds in event.stages.items():
            self.scale_stage.labels(stage=stage).observe(seconds)

    def refresh_models(self, models: Iterable[str], tes: Iterable[TEInfo]) -> None:
        """deepserve_model_tes: every served model, 0 when none of its TEs is listed."""
        counts = {model: 0 for model in models}
        for te in tes:
            counts[te.model] = counts.get(te.model, 0) + 1
        for model, count in counts.items():
            self.model_tes.labels(model=model).set(count)

    def refresh(self, num_running: int, num_waiting: int, te_ids: Iterable[str],
                reports: Mapping[str, TEReport]) -> None:
        """Set the gauges from the job client's current view."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        te_ids = list(te_ids)
        self.num_tes.set(len(te_ids))
        for gauge in (self.te_kv_usage, self.te_prefix_hit_rate, self.te_running,
                      self.te_waiting, self.te_cost_model, self.storage_queue):
            gauge.clear()
        for te_id in te_ids:
            report = reports.get(te_id)
            if report is None:
                continue
            self.te_kv_usage.labels(te_id=te_id).set(report.kv_usage)
            hit_rate = report.num_cached_tokens / max(1, report.num_prompt_tokens)
            self.te_prefix_hit_rate.labels(te_id=te_id).set(hit_rate)
            self.te_running.labels(te_id=te_id).set(report.num_running)
            self.te_waiting.labels(te_id=te_id).set(report.num_waiting)
            self.storage_queue.labels(te_id=te_id).set(report.storage_queue_tokens)
            for param, value in report.cost_model.items():
                self.te_cost_model.labels(te_id=te_id, param=param).set(value)

    def render(self, tenant: str | None = None) -> bytes:
        """The exposition text; tenant: of the per-tenant series (label `tenant`)
        that tenant's only, every other series whole; None: everything."""
        if tenant is None:
            return generate_latest(self.registry)
        return generate_latest(_OneTenant(self.registry, tenant))


class _OneTenant:
    """A view of a registry for generate_latest: every family (HELP and TYPE
    included), less the samples labelled with another tenant (a histogram's
    _bucket, _count, _sum and _created alike)."""

    def __init__(self, registry: CollectorRegistry, tenant: str):
        self.registry = registry
        self.tenant = tenant

    def collect(self):
        for family in self.registry.collect():
            samples = [s for s in family.samples
                       if s.labels.get("tenant", self.tenant) == self.tenant]
            if len(samples) != len(family.samples):
                family = copy.copy(family)
                family.samples = samples
            yield family


def _new(seen: dict, key, total: int) -> int:
    """What a cumulative per-TE count gained since it was last seen (a
    restarted TE starts from 0 again: all of it is new)."""
    last = seen.get(key, 0)
    seen[key] = total
    return total - last if total >= last else total


class RequestCounter:
    """ASGI middleware: count every HTTP answer by endpoint and status code."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app raises before starting a response

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.count_request(scope.get("path", ""), status)
