"""Per-model autoscaler: how many TEs each model should have, tick by tick.

    gateway / JE ─── on_request, on_parked ─┐
    TE reports ───── on_load, on_latency ───┼─> Autoscaler ─ decide(now, tes, starting) ─┐
    cluster manager ─ forget_te ────────────┘      cluster manager starts / stops TEs <─ [Decision]

Pure: no sockets, threads or wall clock; every call carries `now` (seconds,
any monotonic origin). `tes`: a model's TEs that are up; `starting`: how many
are being started (capacity, not removable). Per model, a decide() does at
most one of these, checked in this order:

1. Lower bound: min_tes while the model is active, 0 once idle_s is set and
   idle_s passed with no activity (an arrival, or a request seen parked,
   waiting or running). Construction counts as activity: a model with
   min_tes > 0 starts at boot and goes to zero after idle_s without traffic.
   Requests parked, waiting or running make the bound at least 1. up +
   starting below the bound -> scale out to it (capped at max_tes) at once,
   no cooldown: "demand_from_zero" (none up or starting, parked > 0) or "min_tes".
2. Idle: bound 0 because of idle_s -> one "idle" Decision per up TE.
   Over max_tes (a lost node came back with TEs that were replaced meanwhile,
   or a restart raced a replacement) -> scale in the extra TEs, the least
   loaded first, at once: "over_max".
3. Scale out one TE, if up + starting < max_tes and out_cooldown_s passed
   since the model's last scale-out:
     "queue" waiting (sum over its up TEs) / (up + starting) > out_queue_per_te,
             or parked > 0 with TEs up, all busy, none starting;
     "slo"   none starting, and of the requests finished within window_s and
             since the model's capacity last changed, >= 5 and a fraction
             > 1 - percentile missed ttft_ms or tpot_ms.
4. Scale in one TE, the least loaded (ties: the last id in sorted order),
   "low_load", when all hold: up >= 2 and up - 1 >= bound; nothing parked or
   starting; load / (up - 1) < in_load_per_te (load: waiting + running of up
   TEs), seen continuously by decide for in_sustain_s (hysteresis); no scale
   event of the model for in_cooldown_s; the SLO holds over window_s (miss
   rate <= 1 - percentile, any sample count). The last TE goes only by idle.

No double counting: starting TEs share the queue and take parked requests;
SLO misses before a capacity change (a decision, or the up count moved) are
not counted, so a decision is not repeated while its TEs start. A TE named
in an "in" Decision stops counting as up; it is forgotten when it leaves
`tes` or by forget_te(). Unknown model names are ignored.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping

MIN_SLO_SAMPLES = 5  # finished requests needed in the window before an SLO scale-out
_EPS = 1e-9  # slack on rate comparisons: 1 miss in 10 meets p90 though 1 - 0.9 < 0.1


@dataclass(frozen=True)
class ModelPolicy:
    """Scaling bounds and SLO of one model."""

    name: str
    min_tes: int = 1  # TEs kept while the model is active (0: started on demand only)
    max_tes: int = 2  # never more TEs up + starting than this
    idle_s: float | None = None  # seconds without activity before going to zero (None: never)
    ttft_ms: float | None = None  # time-to-first-token SLO, milliseconds (None: none)
    tpot_ms: float | None = None  # time-per-output-token SLO, milliseconds (None: none)
    percentile: float = 0.9  # fraction of finished requests that must meet the SLO

    def __post_init__(self) -> None:
        if self.min_tes < 0:
            raise ValueError(f"{self.name}: min_tes must be >= 0")
        if self.max_tes < max(1, self.min_tes):
            raise ValueError(f"{self.name}: max_tes must be >= max(1, min_tes)")
        if self.idle_s is not None and self.idle_s <= 0:
            raise ValueError(f"{self.name}: idle_s must be > 0 or None")
        if not 0.0 < self.percentile <= 1.0:
            raise ValueError(f"{self.name}: percentile must be in (0, 1]")


@dataclass(frozen=True)
class ScalingOptions:
    """Thresholds shared by all models; times in seconds."""

    window_s: float = 10.0  # SLO measurement window
    out_queue_per_te: float = 2.0  # mean waiting per TE (up + starting) above which: out
    in_load_per_te: float = 0.5  # mean waiting + running per remaining TE below which: in
    out_cooldown_s: float = 3.0  # min time between two queue/SLO scale-outs of a model
    in_cooldown_s: float = 15.0  # min time after any scale event of a model before a scale-in
    in_sustain_s: float = 10.0  # low load must last this long before a scale-in


@dataclass(frozen=True)
class Decision:
    """One scaling action for the cluster manager to carry out."""

    model: str
    direction: str  # "out" (start `count` TEs) or "in" (stop `te_id`)
    count: int = 1
    te_id: str | None = None
    reason: str = ""  # demand_from_zero | min_tes | queue | slo | idle | low_load
    inputs: dict = field(default_factory=dict)  # the numbers the decision used, for the log


@dataclass
class _Model:
    """What the autoscaler knows of one model."""

    policy: ModelPolicy
    last_active: float
    parked: int = 0
    loads: dict[str, tuple[int, int]] = field(default_factory=dict)  # te -> (waiting, running)
    samples: deque[tuple[float, bool]] = field(default_factory=deque)  # (finished at, missed SLO)
    removing: set[str] = field(default_factory=set)  # named in an "in" Decision, still listed
    last_out: float = -math.inf
    last_event: float = -math.inf
    settled_at: float = -math.inf  # last capacity change: SLO misses before it are stale
    prev_up: int = 0
    low_since: float | None = None


def _miss_rate(samples: Iterable[tuple[float, bool]], since: float) -> tuple[int, float]:
    """(number of samples finished at or after `since`, fraction of them that missed)."""
    flags = [missed for t, missed in samples if t >= since]
    return len(flags), (sum(flags) / len(flags) if flags else 0.0)


class Autoscaler:
    """Per-model scale-out / scale-in decisions from load, SLO and idleness."""

    def __init__(self, policies: Iterable[ModelPolicy], options: ScalingOptions = ScalingOptions(),
                 now: float = 0.0) -> None:
        self.options = options
        self._models = {p.name: _Model(p, last_active=now) for p in policies}

    def on_request(self, model: str, now: float, n: int = 1) -> None:
        """`n` requests arrived for `model`: it is active."""
        m = self._models.get(model)
        if m is not None and n > 0:
            m.last_active = max(m.last_active, now)

    def on_started(self, model: str, now: float) -> None:
        """A TE of `model` came up: its idle time counts from now (a slow start
        must not end in a scale-in before its first request)."""
        m = self._models.get(model)
        if m is not None:
            m.last_active = max(m.last_active, now)

    def on_parked(self, model: str, parked: int, now: float) -> None:
        """Requests of `model` that no TE can take right now (the current count; decide
        counts them as activity)."""
        m = self._models.get(model)
        if m is not None:
            m.parked = max(0, parked)

    def on_load(self, model: str, te_id: str, waiting: int, running: int, now: float) -> None:
        """The latest load report of one TE of `model`."""
        m = self._models.get(model)
        if m is not None:
            m.loads[te_id] = (waiting, running)
            if waiting + running > 0:
                m.last_active = max(m.last_active, now)

    def on_latency(self, model: str, now: float, ttft_ms: float | None = None,
                   tpot_ms: float | None = None) -> None:
        """One finished request of `model`; kept only if the model has an SLO."""
        m = self._models.get(model)
        if m is None or (m.policy.ttft_ms is None and m.policy.tpot_ms is None):
            return
        p = m.policy
        missed = (ttft_ms is not None and p.ttft_ms is not None and ttft_ms > p.ttft_ms) or \
                 (tpot_ms is not None and p.tpot_ms is not None and tpot_ms > p.tpot_ms)
        m.samples.append((now, missed))

    def forget_te(self, te_id: str) -> None:
        """`te_id` is gone: drop its load report and pending removal."""
        for m in self._models.values():
            m.loads.pop(te_id, None)
            m.removing.discard(te_id)

    def decide(self, now: float, tes: Mapping[str, Collection[str]],
               starting: Mapping[str, int] | None = None) -> list[Decision]:
        """The decisions for this tick, at most one kind per model."""
        starting = starting or {}
        decisions: list[Decision] = []
        for name, m in self._models.items():
            decisions += self._decide_model(m, now, set(tes.get(name, ())), starting.get(name, 0))
        return decisions

    def _decide_model(self, m: _Model, now: float, listed: set[str],
                      starting: int) -> list[Decision]:
        opts, p = self.options, m.policy
        m.removing &= listed
        up_ids = sorted(listed - m.removing)
        loads = {t: m.loads.get(t, (0, 0)) for t in up_ids}
        x = self._measure(m, now, loads, starting)
        up, capacity, target = x["up"], x["up"] + starting, min(x["bound"], p.max_tes)
        if capacity < target:
            reason = "demand_from_zero" if capacity == 0 and m.parked else "min_tes"
            return [self._scale_out(m, now, target - capacity, reason, x)]
        if x["is_idle"]:
            if up_ids:
                self._mark_event(m, now)
                m.removing.update(up_ids)
            return [Decision(p.name, "in", te_id=t, reason="idle", inputs=x) for t in up_ids]
        if up > p.max_tes:
            victims = sorted(up_ids, key=lambda t: (sum(loads[t]), up_ids.index(t)))
            victims = victims[:up - p.max_tes]
            self._mark_event(m, now)
            m.removing.update(victims)
            return [Decision(p.name, "in", te_id=t, reason="over_max", inputs=x) for t in victims]
        if capacity < p.max_tes and now - m.last_out >= opts.out_cooldown_s:
            all_busy = all(w + r > 0 for w, r in loads.values())
            is_queue = up > 0 and (x["mean_waiting"] > opts.out_queue_per_te
                                   or (m.parked > 0 and starting == 0 and all_busy))
            is_slo = (starting == 0 and x["slo_samples"] >= MIN_SLO_SAMPLES
                      and x["violation_rate"] > 1.0 - p.percentile + _EPS)
            if is_queue or is_slo:
                return [self._scale_out(m, now, 1, "queue" if is_queue else "slo", x)]
        if (m.low_since is not None and x["low_for_s"] >= opts.in_sustain_s
                and now - m.last_event >= opts.in_cooldown_s and up - 1 >= x["bound"]
                and starting == 0 and x["window_violation_rate"] <= 1.0 - p.percentile + _EPS):
            victim = up_ids[0]
            for t in up_ids:  # least loaded; '<=' so ties go to the last id
                if sum(loads[t]) <= sum(loads[victim]):
                    victim = t
            self._mark_event(m, now)
            m.removing.add(victim)
            return [Decision(p.name, "in", te_id=victim, reason="low_load", inputs=x)]
        return []

    def _measure(self, m: _Model, now: float, loads: dict[str, tuple[int, int]],
                 starting: int) -> dict:
        """This tick's numbers (a Decision's inputs); advances the idle and low-load clocks."""
        opts, p, up = self.options, m.policy, len(loads)
        if up != m.prev_up:
            m.prev_up, m.settled_at = up, now
        while m.samples and m.samples[0][0] < now - opts.window_s:
            m.samples.popleft()
        waiting = sum(w for w, _ in loads.values())
        load = sum(w + r for w, r in loads.values())
        if load or m.parked:  # idleness counts from the last request seen in flight
            m.last_active = max(m.last_active, now)
        idle_for = now - m.last_active
        is_idle = p.idle_s is not None and idle_for >= p.idle_s and not (m.parked or load)
        in_ratio = load / (up - 1) if up >= 2 else math.inf
        is_low = up >= 2 and m.parked == 0 and in_ratio < opts.in_load_per_te
        m.low_since = (now if m.low_since is None else m.low_since) if is_low else None
        n_new, rate_new = _miss_rate(m.samples, m.settled_at)
        return {"up": up, "starting": starting, "parked": m.parked, "waiting": waiting,
                "load": load, "mean_waiting": waiting / (up + starting) if up + starting else 0.0,
                "bound": 0 if is_idle else max(p.min_tes, 1 if m.parked or load else 0),
                "is_idle": is_idle, "idle_for_s": idle_for, "in_ratio": in_ratio,
                "low_for_s": now - m.low_since if m.low_since is not None else 0.0,
                "violation_rate": rate_new, "slo_samples": n_new,
                "window_violation_rate": _miss_rate(m.samples, -math.inf)[1]}

    def _scale_out(self, m: _Model, now: float, count: int, reason: str,
                   inputs: dict) -> Decision:
        self._mark_event(m, now)
        m.last_out = now
        return Decision(m.policy.name, "out", count=count, reason=reason, inputs=inputs)

    @staticmethod
    def _mark_event(m: _Model, now: float) -> None:
        """A scale event: restarts the cooldowns, the low-load clock and the SLO sample set."""
        m.last_event = m.settled_at = now
        m.low_since = None
