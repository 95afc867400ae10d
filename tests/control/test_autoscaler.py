"""Autoscaler on a fake clock: bounds, idleness, queue, SLO, hysteresis, flapping."""

from __future__ import annotations

import random

import pytest

from deepserve.control.cm.autoscaler import Autoscaler, Decision, ModelPolicy, ScalingOptions

M = "m"


class Cluster:
    """Carries out decisions: an "out" TE is up start_s later, an "in" TE is gone at once."""

    def __init__(self, scaler: Autoscaler, start_s: float = 5.0) -> None:
        self.scaler, self.start_s = scaler, start_s
        self.up: list[str] = []
        self.ready_at: list[float] = []  # one per starting TE
        self.num_started = 0
        self.log: list[tuple[float, Decision]] = []

    def tick(self, now: float) -> list[Decision]:
        for _ in [t for t in self.ready_at if t <= now]:
            self.up.append(f"te{self.num_started}")
            self.num_started += 1
        self.ready_at = [t for t in self.ready_at if t > now]
        decisions = self.scaler.decide(now, {M: list(self.up)}, {M: len(self.ready_at)})
        for d in decisions:
            if d.direction == "out":
                self.ready_at += [now + self.start_s] * d.count
            else:
                self.up.remove(d.te_id)
                self.scaler.forget_te(d.te_id)
        self.log += [(now, d) for d in decisions]
        return decisions

    def report(self, now: float, waiting: int = 0, running: int = 0) -> None:
        for te in self.up:
            self.scaler.on_load(M, te, waiting, running, now)


def kinds(decisions: list[Decision]) -> list[tuple[str, str]]:
    return [(d.direction, d.reason) for d in decisions]


def test_policy_is_validated():
    with pytest.raises(ValueError, match="max_tes"):
        ModelPolicy(M, min_tes=3, max_tes=2)
    with pytest.raises(ValueError, match="percentile"):
        ModelPolicy(M, percentile=0.0)


def test_min_tes_started_at_boot_and_kept_while_active():
    scaler = Autoscaler([ModelPolicy(M, min_tes=2, max_tes=4)], ScalingOptions(), now=0.0)
    [boot] = scaler.decide(0.0, {M: []})
    assert (boot.direction, boot.count, boot.reason) == ("out", 2, "min_tes")
    assert boot.inputs["up"] == 0 and boot.inputs["bound"] == 2
    assert scaler.decide(1.0, {M: []}, {M: 2}) == []  # starting TEs are capacity
    for t in range(2, 300):  # no traffic at all, no idle_s: never below min_tes
        for te in ("a", "b"):
            scaler.on_load(M, te, 0, 0, float(t))
        assert scaler.decide(float(t), {M: ["a", "b"]}) == []
    [crash] = scaler.decide(300.0, {M: ["a"]})  # one died: back to the floor at once
    assert (crash.direction, crash.count, crash.reason) == ("out", 1, "min_tes")


def test_idle_to_zero_then_demand_from_zero_once_despite_cooldown():
    opts = ScalingOptions(out_cooldown_s=100.0, in_cooldown_s=100.0)
    scaler = Autoscaler([ModelPolicy(M, min_tes=2, max_tes=3, idle_s=30.0)], opts, now=0.0)
    cluster = Cluster(scaler, start_s=2.0)
    assert kinds(cluster.tick(0.0)) == [("out", "min_tes")]
    for t in range(1, 30):
        cluster.report(float(t))
        assert cluster.tick(float(t)) == [], t
    assert cluster.up == ["te0", "te1"]
    cluster.report(30.0)
    idle = cluster.tick(30.0)  # both at once, despite in_cooldown_s
    assert kinds(idle) == [("in", "idle")] * 2 and {d.te_id for d in idle} == {"te0", "te1"}
    assert idle[0].inputs["idle_for_s"] == 30.0 and cluster.up == []
    assert cluster.tick(31.0) == []  # at zero, nothing asked
    scaler.on_request(M, 32.0)
    scaler.on_parked(M, 1, 32.0)
    [wake] = cluster.tick(32.0)  # within out_cooldown_s of the boot scale-out
    assert (wake.direction, wake.count, wake.reason) == ("out", 2, "demand_from_zero")
    assert wake.inputs["parked"] == 1 and wake.inputs["bound"] == 2  # active again: min_tes
    assert cluster.tick(33.0) == []  # still starting, still parked: not repeated
    scaler.on_parked(M, 0, 34.0)
    assert cluster.tick(34.0) == [] and cluster.up == ["te2", "te3"]


def test_idle_waits_for_in_flight_requests():
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, idle_s=10.0)], ScalingOptions())
    scaler.on_load(M, "a", 0, 1, 0.0)  # a long request keeps it active
    assert scaler.decide(15.0, {M: ["a"]}) == []
    scaler.on_load(M, "a", 0, 0, 16.0)
    assert scaler.decide(24.0, {M: ["a"]}) == []  # 9 s since it was last seen busy
    assert kinds(scaler.decide(25.0, {M: ["a"]})) == [("in", "idle")]
    assert scaler.decide(26.0, {M: ["a"]}) == []  # still stopping: not asked twice
    scaler.on_request(M, 27.0)
    scaler.on_parked(M, 1, 27.0)
    # "a", on its way out, is no capacity
    assert kinds(scaler.decide(27.0, {M: ["a"]})) == [("out", "demand_from_zero")]


def test_max_tes_caps_every_scale_out():
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=3)], ScalingOptions(out_cooldown_s=1.0))
    cluster = Cluster(scaler, start_s=1.0)
    for t in range(100):
        cluster.report(float(t), waiting=50, running=4)
        scaler.on_parked(M, 20, float(t))
        cluster.tick(float(t))
        assert len(cluster.up) + len(cluster.ready_at) <= 3
    assert len(cluster.up) == 3
    assert [d.direction for _, d in cluster.log] == ["out"] * 3


def test_queue_scale_out_then_scale_in_only_after_sustained_low_load():
    opts = ScalingOptions(out_queue_per_te=2.0, in_load_per_te=0.5, in_sustain_s=10.0,
                          in_cooldown_s=5.0)
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=4)], opts)
    scaler.on_load(M, "a", 2, 4, 100.0)
    scaler.on_load(M, "b", 2, 4, 100.0)
    assert scaler.decide(100.0, {M: ["a", "b"]}) == []  # mean waiting 2 is not above 2
    scaler.on_load(M, "b", 3, 4, 100.0)
    [out] = scaler.decide(100.0, {M: ["a", "b"]})
    assert (out.direction, out.count, out.reason) == ("out", 1, "queue")
    assert out.inputs["mean_waiting"] == 2.5
    up = ["a", "b", "c"]
    for t in range(101, 111):  # the burst is over, but low load has not lasted 10 s
        for te in up:
            scaler.on_load(M, te, 0, 0, float(t))
        if t == 104:  # a blip restarts the clock
            scaler.on_load(M, "a", 0, 2, float(t))
        assert scaler.decide(float(t), {M: up}) == [], t
    for t in range(111, 115):
        assert scaler.decide(float(t), {M: up}) == [], t
    [scale_in] = scaler.decide(115.0, {M: up})  # low since 105
    assert (scale_in.direction, scale_in.reason, scale_in.te_id) == ("in", "low_load", "c")
    assert scale_in.inputs["low_for_s"] == 10.0 and scale_in.inputs["up"] == 3
    assert scaler.decide(116.0, {M: up}) == []  # "c" is on its way out, cooldown again
    assert scaler.decide(116.0, {M: ["a", "b"]}) == []


def test_tes_over_max_are_scaled_in_at_once_the_least_loaded_first():
    """A node lost and replaced comes back with its TE: 3 up where max_tes is 2.
    The extra one goes at once (no sustain, no cooldown): the least loaded; at
    max_tes exactly nothing goes."""
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=2)], ScalingOptions(), now=0.0)
    for te, running in (("a", 2), ("b", 0), ("c", 1)):
        scaler.on_load(M, te, 0, running, 0.0)
    [d] = scaler.decide(0.0, {M: ["a", "b", "c"]})
    assert (d.direction, d.te_id, d.reason) == ("in", "b", "over_max")
    assert scaler.decide(0.1, {M: ["a", "b", "c"]}) == []  # b is on its way out
    assert scaler.decide(0.2, {M: ["a", "c"]}) == []


def test_scale_in_picks_least_loaded_and_breaks_ties_last():
    opts = ScalingOptions(in_load_per_te=2.0, in_sustain_s=0.0, in_cooldown_s=0.0)
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=4)], opts)
    for te, running in (("a", 1), ("b", 0), ("c", 1)):
        scaler.on_load(M, te, 0, running, 0.0)
    [d] = scaler.decide(0.0, {M: ["c", "a", "b"]})
    assert (d.direction, d.te_id) == ("in", "b")
    for te in ("a", "b", "c"):
        scaler.on_load(M, te, 0, 0, 1.0)
    [d] = scaler.decide(1.0, {M: ["a", "b", "c"]})
    assert d.te_id == "c"


def test_slo_violations_scale_out_within_slo_traffic_does_not():
    policy = ModelPolicy(M, min_tes=1, max_tes=3, ttft_ms=100.0, tpot_ms=20.0, percentile=0.9)
    scaler = Autoscaler([policy], ScalingOptions(window_s=10.0))
    assert scaler.decide(0.0, {M: ["a"]}) == []
    for i in range(40):  # 1 miss in 10: exactly p90, the SLO holds
        scaler.on_latency(M, 1.0 + i * 0.1, ttft_ms=150.0 if i % 10 == 0 else 50.0, tpot_ms=10.0)
    scaler.on_load(M, "a", 0, 1, 5.0)
    assert scaler.decide(5.0, {M: ["a"]}) == []
    scaler = Autoscaler([policy], ScalingOptions(window_s=10.0))
    assert scaler.decide(0.0, {M: ["a"]}) == []
    for i in range(4):
        scaler.on_latency(M, 1.0 + i, ttft_ms=50.0, tpot_ms=30.0)  # tpot misses
    assert scaler.decide(5.0, {M: ["a"]}) == []  # 4 samples are not enough
    scaler.on_latency(M, 5.0, ttft_ms=50.0, tpot_ms=30.0)
    [out] = scaler.decide(5.0, {M: ["a"]})
    assert (out.direction, out.reason) == ("out", "slo")
    assert out.inputs["violation_rate"] == 1.0 and out.inputs["slo_samples"] == 5
    for i in range(5):  # still missing while "b" starts: "b" is on it
        scaler.on_latency(M, 5.5 + i * 0.5, ttft_ms=500.0)
    assert scaler.decide(8.0, {M: ["a"]}, {M: 1}) == []
    assert scaler.decide(9.0, {M: ["a", "b"]}) == []  # misses from before "b" joined are stale
    for i in range(5):
        scaler.on_latency(M, 10.0 + i, ttft_ms=500.0)
    assert kinds(scaler.decide(14.0, {M: ["a", "b"]})) == [("out", "slo")]


def test_slo_misses_block_scale_in():
    opts = ScalingOptions(in_sustain_s=0.0, in_cooldown_s=0.0, window_s=10.0)
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=2, ttft_ms=100.0)], opts)
    scaler.on_latency(M, 1.0, ttft_ms=900.0)
    assert scaler.decide(2.0, {M: ["a", "b"]}) == []  # idle TEs, but the SLO was missed
    assert kinds(scaler.decide(12.0, {M: ["a", "b"]})) == [("in", "low_load")]


def test_starting_tes_are_not_double_counted():
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=4, ttft_ms=100.0)],
                        ScalingOptions(out_cooldown_s=1.0))
    scaler.on_load(M, "a", 3, 4, 0.0)
    assert kinds(scaler.decide(0.0, {M: ["a"]})) == [("out", "queue")]  # 3 waiting on 1 TE
    for t in range(1, 30):  # the TE starts for 30 s; 3 waiting over 2 TEs is fine
        scaler.on_load(M, "a", 3, 4, float(t))
        scaler.on_latency(M, float(t), ttft_ms=900.0)
        assert scaler.decide(float(t), {M: ["a"]}, {M: 1}) == [], t
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=4)], ScalingOptions(out_cooldown_s=1.0))
    scaler.on_load(M, "a", 0, 4, 0.0)
    scaler.on_parked(M, 2, 0.0)  # parked, and the only TE is busy
    assert kinds(scaler.decide(0.0, {M: ["a"]})) == [("out", "queue")]
    for t in range(1, 10):
        assert scaler.decide(float(t), {M: ["a"]}, {M: 1}) == [], t


@pytest.mark.parametrize("seed", range(5))
def test_steady_moderate_load_for_ten_minutes_does_not_flap(seed):
    rng = random.Random(seed)
    scaler = Autoscaler([ModelPolicy(M, min_tes=1, max_tes=4, idle_s=60.0)], ScalingOptions())
    cluster = Cluster(scaler, start_s=20.0)
    slots = 4  # concurrent requests one TE runs; the rest wait
    for t in range(600):
        now = float(t)
        in_flight = rng.randint(4, 8)
        scaler.on_request(M, now, n=2)
        for i, te in enumerate(cluster.up):
            share = in_flight // len(cluster.up) + (i < in_flight % len(cluster.up))
            scaler.on_load(M, te, max(0, share - slots), min(share, slots), now)
        scaler.on_parked(M, 0 if cluster.up else in_flight, now)
        cluster.tick(now)
    changes = [d for now, d in cluster.log if now > 0.0]
    assert kinds(changes) == [("out", "queue")]  # one TE queues; two carry it
    [boot] = [d for now, d in cluster.log if now == 0.0]  # parked already: demand_from_zero
    assert (boot.direction, boot.count) == ("out", 1)
    assert len(changes) <= 1 and all(d.direction == "out" for d in changes)
    assert 1 <= len(cluster.up) <= 2


def test_unknown_models_are_ignored_and_forget_te_drops_reports():
    scaler = Autoscaler([ModelPolicy(M, min_tes=0, max_tes=2)], ScalingOptions())
    scaler.on_request("other", 0.0)
    scaler.on_parked("other", 3, 0.0)
    scaler.on_load("other", "x", 9, 9, 0.0)
    scaler.on_latency("other", 0.0, ttft_ms=1.0)
    assert scaler.decide(0.0, {"other": ["x"]}) == []  # min_tes 0, nothing of M pending
    scaler.on_load(M, "a", 9, 0, 1.0)
    assert kinds(scaler.decide(1.0, {M: ["a"]})) == [("out", "queue")]
    scaler.forget_te("a")
    assert scaler.decide(10.0, {M: ["a"]}) == []  # its stale queue is gone
