"""The counters a TEReport carries cumulatively become Prometheus counters
that grow by what is new: per TE, across reports and across a TE restart."""

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from deepserve.gateway.metrics import GatewayMetrics
from deepserve.messages.control import TEReport


def _report(te_id, read_paths, read_bytes=None):
    return TEReport(te_id=te_id, num_waiting=0, num_running=0, load_tokens=0, kv_usage=0.0,
                    read_paths=read_paths, storage_read_bytes=read_bytes or {})


def _samples(metrics, name):
    return {tuple(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(metrics.render().decode())
            for s in fam.samples if s.name == name}


def test_dualpath_decisions_add_up_over_tes_reports_and_a_restart():
    m = GatewayMetrics()
    m.observe_te_report(_report("d0", {"prefill": 2, "decode": 1}))
    m.observe_te_report(_report("d1", {"decode": 3}))
    m.observe_te_report(_report("d0", {"prefill": 2, "decode": 4}))  # 3 new decode
    m.observe_te_report(_report("d1", {"decode": 1}))  # restarted: counts from 0 again
    got = _samples(m, "deepserve_dualpath_decisions_total")
    assert got == {(("path", "prefill"),): 2.0, (("path", "decode"),): 1 + 3 + 3 + 1}


def test_decisions_and_read_bytes_keep_separate_books():
    """Both are counted per (TE, path): one must not eat the other's delta."""
    m = GatewayMetrics()
    m.observe_te_report(_report("d0", {"decode": 5}, {"decode": 100}))
    m.observe_te_report(_report("d0", {"decode": 6}, {"decode": 150}))
    assert _samples(m, "deepserve_dualpath_decisions_total") == {(("path", "decode"),): 6.0}
    assert _samples(m, "deepserve_storage_read_bytes_total") == {
        (("path", "decode"), ("te_id", "d0")): 150.0}


def test_tier_lookups_count_new_outcomes_per_te():
    m = GatewayMetrics()
    base = _report("p0", {})
    m.observe_te_report(msgspec.structs.replace(base, tier_lookups={"fetch": 2, "no_room": 5}))
    m.observe_te_report(msgspec.structs.replace(base, tier_lookups={"fetch": 3, "no_room": 5,
                                                                    "room_timeout": 1}))
    m.observe_te_report(msgspec.structs.replace(_report("p1", {}), tier_lookups={"fetch": 4}))
    assert _samples(m, "deepserve_tier_lookups_total") == {
        (("outcome", "fetch"),): 7.0, (("outcome", "no_room"),): 5.0,
        (("outcome", "room_timeout"),): 1.0}
