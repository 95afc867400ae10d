"""The cluster manager's scaling loop: the autoscaler's inputs and decisions.

    TEReport (load) ─┐
    ModelDemand (JE: arrivals, held requests, latencies) ─┼─> Autoscaler (autoscaler.py, pure)
    TE list (up, starting, restarting) ─┘                     │ decide() every CM step
                                  ScaleOut ──> supervisor ◄───┤
       drain: TEInfo.draining in the TE list (the JE routes it nothing new),
       its report shows no work ──> ScaleIn ──> supervisor stops it ──> TEDown

Capacity a decision must not double count: TEs being started for a
ScaleOut (`starting`, until a new TE of the model says TEUp, or the
supervisor reports the start failed, or startup_timeout_s), and TEs that
went down by a fault (`restarting`: the supervisor restarts them itself,
from the pre-warmed pool when it can) until they are back or the timeout.

A TE is drained before it is stopped, so scale-in loses nothing: the CM
lists it as draining; once DRAIN_SETTLE_S has passed (the JE has seen the
list) and its report shows nothing waiting or running, the supervisor is
told to stop it (after DRAIN_TIMEOUT_S regardless: what it still ran then
resumes elsewhere, as after a crash).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from deepserve.control.cm.autoscaler import Autoscaler, Decision, ModelPolicy, ScalingOptions
from deepserve.messages.control import TEInfo, TEReport
from deepserve.messages.scaling import ModelDemand, ScaleEvent, ScaleIn, ScaleOut

log = logging.getLogger(__name__)
DRAIN_SETTLE_S = 1.0
DRAIN_TIMEOUT_S = 60.0


def policies_of(models: Iterable) -> list[ModelPolicy]:
    """ModelSpecs (config/models.py) of scalable models -> the autoscaler's policies."""
    return [ModelPolicy(name=m.name, min_tes=m.min_tes, max_tes=m.max_tes, idle_s=m.idle_s,
                        ttft_ms=m.slo.ttft_ms, tpot_ms=m.slo.tpot_ms,
                        percentile=m.slo.percentile) for m in models if m.scalable]


def options_of(scaling) -> ScalingOptions:
    """[scaling] (ScalingSection) -> the autoscaler's options (same names)."""
    names = ScalingOptions.__dataclass_fields__
    return ScalingOptions(**{k: getattr(scaling, k) for k in names if hasattr(scaling, k)})


class ScalingControl:
    """send(msg): to the supervisor; events(event, **details): the health log;
    initial: te id -> model of the TEs the node starts itself (min_tes)."""

    def __init__(self, policies: list[ModelPolicy], options: ScalingOptions,
                 send: Callable, events: Callable, now: float, startup_timeout_s: float,
                 initial: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic):
        self.autoscaler = Autoscaler(policies, options, now)
        self.clock = clock
        self.models = {p.name for p in policies}
        self.send, self.events = send, events
        self.startup_timeout_s = startup_timeout_s
        self.starting: dict[str, list[float]] = {m: [] for m in self.models}
        for model in (initial or {}).values():
            self.starting.setdefault(model, []).append(now + startup_timeout_s)
        self.seen: set[str] = set()  # TE ids ever up (a new one fills a starting slot)
        self.restarting: dict[str, tuple[str, float]] = {}
        self.draining: dict[str, tuple[str, float]] = {}  # te id -> (model, since)
        self.retiring: set[str] = set()

    # -- inputs ------------------------------------------------------------------
    def on_te_up(self, info: TEInfo, now: float) -> None:
        self.restarting.pop(info.te_id, None)
        if info.te_id not in self.seen and info.model in self.starting:
            self.seen.add(info.te_id)
            self.autoscaler.on_started(info.model, now)
            if self.starting[info.model]:
                self.starting[info.model].pop(0)

    def on_te_down(self, te_id: str, model: str, reason: str, now: float) -> None:
        self.autoscaler.forget_te(te_id)
        self.draining.pop(te_id, None)
        if te_id in self.retiring:
            self.retiring.discard(te_id)
        elif model in self.models and reason != "shutdown":
            self.restarting[te_id] = (model, now + self.startup_timeout_s)

    def on_report(self, report: TEReport, model: str, now: float) -> None:
        if model in self.models:
            self.autoscaler.on_load(model, report.te_id, report.num_waiting, report.num_running,
                                    now)
        drain = self.draining.get(report.te_id)
        if drain is None:
            return
        idle = report.num_waiting == 0 and report.num_running == 0
        waited = now - drain[1]
        if (idle and waited >= DRAIN_SETTLE_S) or waited >= DRAIN_TIMEOUT_S:
            del self.draining[report.te_id]
            self.retiring.add(report.te_id)
            self.send(ScaleIn(te_id=report.te_id, model=drain[0],
                              reason="drained" if idle else "drain timeout"))

    def on_demand(self, msg: ModelDemand, now: float) -> None:
        for model, n in msg.arrivals.items():
            if n > 0:
                self.autoscaler.on_request(model, now, n)
        for model, n in msg.parked.items():
            self.autoscaler.on_parked(model, n, now)
        for model, samples in msg.latencies.items():
            for ttft_ms, tpot_ms in samples:
                # dated by arrival (finish - TTFT, or earlier): a request that waited
                # for a TE to start is not held against the TEs up once it is served
                arrived = now - (ttft_ms or 0.0) / 1e3
                self.autoscaler.on_latency(model, arrived, ttft_ms=ttft_ms, tpot_ms=tpot_ms)

    def on_scale_event(self, msg: ScaleEvent) -> None:
        if msg.direction == "failed" and self.starting.get(msg.model):
            self.starting[msg.model].pop(0)

    def is_held(self, te_id: str) -> bool:
        """Draining or retiring: its TEUp must not clear the draining mark."""
        return te_id in self.draining or te_id in self.retiring

    # -- deciding ------------------------------------------------------------------
    def step(self, now: float, tes: dict[str, TEInfo]) -> list[str]:
        """Decide; send scale-outs; the TE ids that start draining now."""
        for model, deadlines in self.starting.items():
            deadlines[:] = [d for d in deadlines if d > now]
        self.restarting = {t: v for t, v in self.restarting.items() if v[1] > now}
        up: dict[str, list[str]] = {m: [] for m in self.models}
        for te in tes.values():
            if te.model in up and te.te_id not in self.draining and te.te_id not in self.retiring:
                up[te.model].append(te.te_id)
        starting = {m: len(d) for m, d in self.starting.items()}
        for model, _ in self.restarting.values():
            starting[model] = starting.get(model, 0) + 1
        drained = []
        for decision in self.autoscaler.decide(now, up, starting):
            self._log(decision)
            if decision.direction == "out":
                self.starting[decision.model].extend(
                    [now + self.startup_timeout_s] * decision.count)
                self.send(ScaleOut(model=decision.model, count=decision.count,
                                   reason=decision.reason, inputs=decision.inputs,
                                   decided_at=self.clock()))
            elif decision.te_id is not None and decision.te_id in tes:
                self.draining[decision.te_id] = (decision.model, now)
                self.autoscaler.forget_te(decision.te_id)
                drained.append(decision.te_id)
        return drained

    def _log(self, d: Decision) -> None:
        log.warning("autoscaler: %s %s x%d (%s) %s", d.model, d.direction, d.count,
                    d.te_id or "", d.reason)
        self.events("scale_decision", model=d.model, direction=d.direction, count=d.count,
                    te_id=d.te_id, reason=d.reason, inputs=d.inputs)
