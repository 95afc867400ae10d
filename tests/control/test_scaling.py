"""The cluster manager's scaling loop (control/cm/scaling.py): what it sends the
supervisor, what it drains, and what it counts as capacity, on a fake clock."""

from __future__ import annotations

from deepserve.config.models import ModelSpec, ScalingSection, SLOSection
from deepserve.control.cm.scaling import (DRAIN_SETTLE_S, DRAIN_TIMEOUT_S, ScalingControl,
                                       options_of, policies_of)
from deepserve.messages.control import TEInfo, TEReport
from deepserve.messages.scaling import ModelDemand, ScaleEvent, ScaleIn, ScaleOut


def control(min_tes=1, max_tes=3, idle_s=None, initial=None, **scaling):
    sent, events = [], []
    spec = ModelSpec(name="m", path="/m", min_tes=min_tes, max_tes=max_tes, idle_s=idle_s)
    c = ScalingControl(policies_of([spec]), options_of(ScalingSection(**scaling)), sent.append,
                       lambda event, **d: events.append((event, d)), 0.0, 60.0, initial)
    return c, sent, events


def te(te_id, model="m"):
    return TEInfo(te_id=te_id, model=model, address=f"ipc://{te_id}")


def report(te_id, waiting=0, running=0):
    return TEReport(te_id=te_id, num_waiting=waiting, num_running=running, load_tokens=0,
                    kv_usage=0.0)


def test_policies_and_options_come_from_the_config():
    spec = ModelSpec(name="a", path="/a", min_tes=0, max_tes=4, idle_s=9.0,
                     slo=SLOSection(ttft_ms=50.0, percentile=0.5))
    static = ModelSpec(name="s", path="/s", scalable=False)
    [p] = policies_of([spec, static])
    assert (p.name, p.min_tes, p.max_tes, p.idle_s, p.ttft_ms, p.percentile) == (
        "a", 0, 4, 9.0, 50.0, 0.5)
    assert options_of(ScalingSection(in_sustain_s=1.5, pool_size=0)).in_sustain_s == 1.5


def test_the_nodes_own_starts_count_until_their_te_is_up_and_then_no_more_is_asked():
    c, sent, _ = control(min_tes=1, initial={"m-0": "m"})
    assert c.step(1.0, {}) == [] and sent == []  # m-0 is starting: no second TE
    c.on_te_up(te("m-0"), 2.0)
    assert c.step(2.0, {"m-0": te("m-0")}) == [] and sent == []


def test_a_model_at_zero_scales_out_once_on_demand_and_idle_drains_then_stops():
    c, sent, events = control(min_tes=1, idle_s=5.0, initial={})
    c.step(0.0, {})
    assert [type(m) for m in sent] == [ScaleOut]  # min_tes at boot
    c.on_te_up(te("m-0"), 1.0)
    sent.clear()
    assert c.step(3.0, {"m-0": te("m-0")}) == []
    drained = c.step(7.0, {"m-0": te("m-0")})  # idle for idle_s since it came up
    assert drained == ["m-0"] and sent == [] and c.is_held("m-0")
    assert any(e == "scale_decision" and d["reason"] == "idle" for e, d in events)
    c.on_report(report("m-0", running=1), "m", 7.5)  # a request routed before it drained
    assert sent == []
    c.on_report(report("m-0"), "m", 7.5 + DRAIN_SETTLE_S)
    assert sent == [ScaleIn(te_id="m-0", model="m", reason="drained")]
    c.on_te_down("m-0", "m", "shutdown", 9.0)
    assert not c.is_held("m-0") and c.restarting == {}
    sent.clear()
    c.on_demand(ModelDemand(arrivals={"m": 1}, parked={"m": 1}), 20.0)
    c.step(20.0, {})
    c.step(20.2, {})
    assert [(type(m), m.model, m.count, m.reason) for m in sent] == [
        (ScaleOut, "m", 1, "demand_from_zero")]
    assert sent[0].decided_at > 0  # the supervisor times the scale-out from it


def test_a_drain_that_never_empties_is_stopped_after_the_timeout():
    c, sent, _ = control(min_tes=0, idle_s=1.0, initial={})
    c.on_te_up(te("m-0"), 0.0)
    assert c.step(2.0, {"m-0": te("m-0")}) == ["m-0"]
    c.on_report(report("m-0", running=2), "m", 2.0 + DRAIN_TIMEOUT_S - 1)
    assert sent == []
    c.on_report(report("m-0", running=2), "m", 2.0 + DRAIN_TIMEOUT_S)
    assert sent == [ScaleIn(te_id="m-0", model="m", reason="drain timeout")]


def test_a_te_down_by_fault_counts_as_restarting_not_as_lost_capacity():
    c, sent, _ = control(min_tes=2, initial={"m-0": "m", "m-1": "m"})
    for t in ("m-0", "m-1"):
        c.on_te_up(te(t), 1.0)
    c.on_te_down("m-1", "m", "supervisor: process fault", 2.0)
    c.step(2.0, {"m-0": te("m-0")})
    assert sent == []  # the supervisor restarts m-1 itself
    c.on_te_up(te("m-1"), 4.0)
    assert c.restarting == {}
    c.on_te_down("m-1", "m", "supervisor: process fault", 5.0)
    c.step(5.0 + 60.0, {"m-0": te("m-0")})  # it never came back: replaced
    assert [type(m) for m in sent] == [ScaleOut]


def test_a_failed_start_frees_its_slot():
    c, sent, _ = control(min_tes=1, initial={})
    c.step(0.0, {})
    assert len(sent) == 1
    c.step(1.0, {})
    assert len(sent) == 1
    c.on_scale_event(ScaleEvent(model="m", te_id="m-0", direction="failed"))
    c.step(2.0, {})
    assert len(sent) == 2 and isinstance(sent[1], ScaleOut)


def test_other_models_tes_and_unknown_models_are_left_alone():
    c, sent, _ = control(min_tes=1, initial={"m-0": "m"})
    c.on_te_up(te("m-0"), 0.0)
    c.on_demand(ModelDemand(arrivals={"zz": 3}, parked={"zz": 2}), 1.0)
    c.on_report(report("o-0", waiting=50), "other", 1.0)
    assert c.step(1.0, {"m-0": te("m-0"), "o-0": te("o-0", "other")}) == [] and sent == []


def test_gateway_latencies_past_the_slo_scale_out_and_within_it_do_not():
    sent, events = [], []
    spec = ModelSpec(name="m", path="/m", min_tes=1, max_tes=2,
                     slo=SLOSection(ttft_ms=100.0, percentile=0.9))
    c = ScalingControl(policies_of([spec]), options_of(ScalingSection()), sent.append,
                       lambda event, **d: events.append((event, d)), 0.0, 60.0, {"m-0": "m"})
    c.on_te_up(te("m-0"), 0.0)
    c.on_demand(ModelDemand(arrivals={"m": 10}, latencies={"m": [(50.0, 5.0)] * 10}), 1.0)
    c.step(1.0, {"m-0": te("m-0")})
    assert sent == []
    c.on_demand(ModelDemand(arrivals={"m": 10}, latencies={"m": [(500.0, 5.0)] * 10}), 2.0)
    c.step(2.0, {"m-0": te("m-0")})
    assert [(type(m), m.reason) for m in sent] == [(ScaleOut, "slo")]


def test_requests_that_waited_for_a_start_do_not_count_against_the_slo():
    sent = []
    spec = ModelSpec(name="m", path="/m", min_tes=0, max_tes=2,
                     slo=SLOSection(ttft_ms=1000.0, percentile=0.9))
    c = ScalingControl(policies_of([spec]), options_of(ScalingSection()), sent.append,
                       lambda event, **d: None, 0.0, 60.0, {})
    c.on_demand(ModelDemand(arrivals={"m": 6}, parked={"m": 6}), 1.0)
    c.step(1.0, {})
    assert [m.reason for m in sent] == ["demand_from_zero"]
    c.on_te_up(te("m-0"), 9.0)  # 8 s to start: the six waited that long
    c.step(9.0, {"m-0": te("m-0")})
    c.on_demand(ModelDemand(parked={"m": 0}, latencies={"m": [(8200.0, 5.0)] * 6}), 9.5)
    c.step(9.6, {"m-0": te("m-0")})
    assert len(sent) == 1  # no "slo" scale-out for the start's own wait
