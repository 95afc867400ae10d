"""One drill against a running node: load, fault, proof, recovery, report.

    wait until /health lists every TE (and a signal target has a pid)
    -> reference: each prompt once, greedy  (drop-cache: the cache probe, twice)
    -> load in a thread -> warm-up -> inject (injection.py)
    -> watch, every POLL_S:
         proof (proof.py)       settled: proven, or failed -> stop at once
         detection              the first DETECT_EVENTS event of the TE (the
                                scenario's detect_events: disk-full, corrupt-disk)
         recovery               restarting: the TE's "recovered" (or "failed": gave up)
                                slow: lifted after hold_s, then a success after that
                                (disk-full: and its recovered_event, the tier back on)
                                one-shot hooks: file consumed, then a success after that
       at most RECOVERY_BOUND = 6 x the largest deadline + 30 s after the fault,
       and at least `duration_s` of load in all, `settle_s` more after recovery
    -> stop load -> final proof look -> report (report.py)

Load and clock: stream.now (epoch seconds), the health log's clock too.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Callable

from deepserve.drill.health_events import HealthEvents, te_of
from deepserve.drill.injection import Injection, wait_pid
from deepserve.drill.load import LoadDriver
from deepserve.drill.poison import PoisonRequest, Quarantined, has_recovered, poison_ids, summary
from deepserve.drill.prompts import (make_long_prompts, make_probe_prompt, make_prompts,
                                     token_counter)
from deepserve.drill.proof import (CacheMissed, FaultProof, HeadLost, HookFired, Logged,
                                   NodeLost, Proofs, SignalDetected, TECrashed, TransferResumed)
from deepserve.drill.report import DrillReport, build_report
from deepserve.drill.scenarios import DETECT_EVENTS, RECOVERED, TE_REMOVED, Scenario, deadline_of
from deepserve.drill.stream import COMPLETED, RequestRecord, first_success_after, now
from deepserve.drill.target import POLL_S, aim, model_dir, placed_target, wait_tes
from deepserve.supervisor.node import num_tes

FIRE_BOUND_S = 15.0
"""A hook fault must show its fault_injected event within this long."""


def recovery_bound_s(supervisor) -> float:
    """How long after the fault the drill waits for recovery at most."""
    deadlines = [getattr(supervisor, "heartbeat_deadline_s", 3.0),
                 getattr(supervisor, "progress_deadline_s", 5.0)]
    return 6 * max(deadlines) + 30


def run_drill(scenario: Scenario, *, url: str, model: str, config=None,
              log_dir: str | Path | None = None, drill_dir: str | Path | None = None,
              duration_s: float = 10.0, concurrency: int = 3, max_tokens: int = 16,
              warmup_s: float = 2.0, settle_s: float = 2.0, request_timeout_s: float = 30.0,
              prompts: list[str] | None = None, te: str | None = None,
              fire_bound_s: float = FIRE_BOUND_S, echo=lambda msg: None,
              cluster=None) -> DrillReport:
    """One drill against the node at `url`. config: its NodeConfig (TE types,
    supervisor deadlines, PD threshold); None: the health log's details and the
    supervisor defaults. te: the target TE (default: te0, or the first TE of the
    scenario's te_type). log_dir (the node's health log) is needed by every
    scenario: it holds the proof. cluster: the LocalCluster (drill/cluster.py)
    kill-node runs on. The report's details hold what its keys do not."""
    drill = Drill(scenario, url=url, model=model, config=config, log_dir=log_dir,
                  drill_dir=drill_dir, te=te, fire_bound_s=fire_bound_s, echo=echo,
                  cluster=cluster)
    drill.prepare(prompts, concurrency=concurrency, max_tokens=max_tokens,
                  request_timeout_s=request_timeout_s)
    return drill.run(duration_s=duration_s, warmup_s=warmup_s, settle_s=settle_s)


class Drill:
    """The state of one drill run; run_drill is its one caller."""

    def __init__(self, scenario: Scenario, *, url: str, model: str, config, log_dir, drill_dir,
                 te: str | None, fire_bound_s: float, echo, cluster=None):
        if log_dir is None:
            raise RuntimeError(f"{scenario.name}: the fault's proof, detection and recovery "
                               "come from the health log: give --log-dir")
        self.poison: PoisonRequest | None = None  # the poison drill's request of death
        self.poison_prompt: list[int] = []
        if scenario.fault == "poison":  # the hook file holds the marker's token ids
            marker, self.poison_prompt = poison_ids(getattr(config, "model", None))
            scenario = dataclasses.replace(scenario, hook_content=",".join(map(str, marker)))
        self.scenario, self.url, self.model, self.config = scenario, url, model, config
        self.events = HealthEvents(log_dir)
        self.drill_dir, self.fire_bound_s, self.echo = drill_dir, fire_bound_s, echo
        self.supervisor = getattr(config, "supervisor", None)
        if config is not None:
            self.te_types = {spec.te_id: spec.te_type for spec in config.tes}
        else:
            self.te_types = self.events.te_types()
        self.cluster = cluster
        self.num_tes = (cluster.num_tes if cluster is not None
                        else len(config.tes) if config is not None else 1)
        self.te, components = aim(scenario, te, self.te_types, cluster)
        self.injection = Injection(scenario, self.te, components,
                                   disk_dir=getattr(getattr(config, "node", None),
                                                    "disk_cache_dir", None) or None)
        if scenario.kills_node:
            self.injection.killer = lambda: cluster.kill_node(self.te)
        self.deadline_s = deadline_of(scenario, self.supervisor,
                                      getattr(getattr(config, "node", None), "te_timeout_s", 10),
                                      getattr(getattr(config, "cluster", None), "failover_s", 4))
        self.bound_s = recovery_bound_s(self.supervisor)
        if scenario.fault == "poison":  # resume-once: up to two TE restarts, one after the other
            self.bound_s *= 2
        self.detected: dict | None = None
        self.recovered: dict | None = None
        self.gave_up: dict | None = None
        self.consumed_at: float | None = None
        self.done_at: float | None = None
        self.proof: FaultProof | None = None
        self.driver: LoadDriver | None = None
        self.records: Callable[[], list[RequestRecord]] = lambda: list(self.driver.records)
        """The load whose completed requests show recovery (arm() may give another)."""
        self.reference: dict[int, list[int]] = {}
        self.probe_prompt = ""
        self.probe_before: int | None = None

    # -- before the fault -------------------------------------------------------------
    def prepare(self, prompts: list[str] | None, **driver_options) -> None:
        config = self.config
        min_len = (config.router.pd_options.min_prompt_len
                   if config is not None and config.router.pd_policy is not None else None)
        counter = token_counter(model_dir(config)) if config is not None else None
        if prompts is None and self.scenario.prompt_tokens:
            prompts = make_long_prompts(self.scenario.prompt_tokens, counter)
        if prompts is None:
            prompts = make_prompts(min_len, counter)
        self.echo(f"drill {self.scenario.name}: {self.scenario.description}; "
                  f"target {', '.join(self.injection.components)}")
        wait_tes(self.url, self.num_tes, self.bound_s)
        self.driver = LoadDriver(self.url, self.model, prompts=prompts, **driver_options)
        self.reference = self.driver.reference_sync()  # scale-across: from zero
        if self.scenario.scales_across:  # the node the model's first TE went to
            node, te_id = placed_target(self.events, self.config, self.model)
            self.te = self.injection.te = node
            self.injection.components = [te_id]
            self.echo(f"the model's TE went to {node}: target {te_id}")
        self.arm(self.driver)

    def arm(self, driver: LoadDriver,
            records: Callable[[], list[RequestRecord]] | None = None) -> None:
        """Get ready to inject: the signal target's pid known, the poison
        request made, the cache probe cached. driver sends the probe and the
        poison; records() is the load whose completions show recovery
        (default: the driver's own). bin/deepserve-chaos arms a drill this way
        under its own load."""
        self.driver = driver
        if records is not None:
            self.records = records
        if self.scenario.is_signal:
            wait_pid(self.events, self.injection.component, self.bound_s)
        if self.scenario.fault == "poison":
            self.poison = PoisonRequest(self.driver, self.poison_prompt)
        if self.scenario.fault == "corrupt":
            self.injection.fill_disk(lambda: self.driver.send_sync(make_probe_prompt(None, None)))
        if self.scenario.fault == "drop-cache":
            config = self.config
            min_len = (config.router.pd_options.min_prompt_len
                       if config is not None and config.router.pd_policy is not None else None)
            counter = token_counter(model_dir(config)) if config is not None else None
            self.probe_prompt = make_probe_prompt(min_len, counter)
            self.driver.send_sync(self.probe_prompt)  # fills the cache
            self.probe_before = self.driver.send_sync(self.probe_prompt).cached_tokens
            self.echo(f"cache probe: {self.probe_before} cached tokens before the drop")

    def _make_proof(self, fault_at: float) -> FaultProof:
        inj, s = self.injection, self.scenario
        if s.kills_head:
            return HeadLost(self.events, inj.pids, fault_at)
        if s.kills_node:
            return NodeLost(self.events, inj.components, inj.pids, fault_at,
                            node=self.te if s.scales_across else None)
        if s.is_signal:
            return SignalDetected(self.events, self.te, inj.component, inj.pid, inj.te_pid,
                                  fault_at)
        if s.fault == "corrupt":
            return Logged(self.events, "cache_block_corrupt", None, fault_at, failure=None
                          if inj.corrupted else "no block file to corrupt: the disk tier "
                                                "held none")
        fired = HookFired(self.events, inj.components, s.fault, fault_at, self.fire_bound_s)
        if s.fault == "disk-full":  # a fresh prompt: new blocks, a disk write that fails
            return Proofs([fired, Logged(self.events, "cache_tier_disabled", s.part, fault_at,
                                         after=fired, poke=lambda: self.driver.send_sync(
                                             make_probe_prompt(None, None)))])
        if s.fault == "drop-cache":
            return Proofs([fired, CacheMissed(fired, lambda: self.driver.send_sync(
                self.probe_prompt), self.probe_before)])
        if s.fault == "kv-fail":
            return Proofs([fired, TransferResumed(self.events, fault_at)])
        if s.fault == "poison":
            return Proofs([fired, Quarantined(self.events, self.poison, fault_at)])
        if s.fault == "stage-die":
            return Proofs([fired, TECrashed(self.events, self.te, fault_at)])
        return fired

    # -- the fault, under load ----------------------------------------------------------
    def run(self, *, duration_s: float, warmup_s: float, settle_s: float) -> DrillReport:
        result: dict = {}

        def load() -> None:
            try:
                result["records"] = self.driver.run_sync()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                result["error"] = exc

        thread = threading.Thread(target=load, name="drill-load", daemon=True)
        load_start = now()
        thread.start()
        try:
            time.sleep(warmup_s)
            fault_at = self.inject()
            while thread.is_alive() and self._watch(now(), fault_at, load_start + duration_s,
                                                    settle_s):
                time.sleep(POLL_S)
        finally:
            self.cleanup()
            self.driver.stop()
            thread.join()
            if self.poison is not None:
                self.poison.join(self.driver.deadline_s + 1.0)
        if "error" in result:
            raise RuntimeError(f"load failed: {result['error']!r}") from result["error"]
        return self._report(result["records"], fault_at)

    def inject(self) -> float:
        """Apply the fault (after prepare or arm); its time, epoch seconds."""
        fault_at = self.injection.inject(self.events, self.drill_dir)
        self.proof = self._make_proof(fault_at)
        if self.poison is not None:
            self.poison.start()
        pid = f", pid {self.injection.pid}" if self.injection.pid else ""
        self.echo(f"fault injected at {fault_at:.3f} ({self.scenario.fault} -> "
                  f"{', '.join(self.injection.components)}{pid})")
        return fault_at

    def cleanup(self) -> None:
        """Take the fault back whatever happened (injection.cleanup)."""
        self.injection.cleanup()

    def _watch(self, t: float, fault_at: float, min_end: float, settle_s: float) -> bool:
        """One look at the proof, the health log and the load; False: stop now."""
        if self.poll(t, fault_at) is not None:
            return False
        return not (self.done_at is not None and t >= self.done_at + settle_s and t >= min_end)

    def poll(self, t: float, fault_at: float) -> str | None:
        """One look at the proof, the health log and the load: None while there
        is more to see; "unproven" (the proof failed), "recovered" (proof
        settled and recovery seen) or "timeout" (recovery bound passed)."""
        self.proof.poll(t)
        if self.proof.failure is not None:
            self.echo(f"fault not proven: {self.proof.failure}")
            return "unproven"
        self._look_at_events(fault_at)
        if self.done_at is None and self.proof.is_settled and self._has_recovered(t, fault_at):
            self.done_at = t
        if t >= fault_at + self.bound_s:
            self.echo(f"no recovery within {self.bound_s:.0f} s of the fault")
            return "timeout"
        return "recovered" if self.done_at is not None else None

    def _look_at_events(self, fault_at: float) -> None:
        te, events = self.te, self.events
        if self.detected is None:
            self.detected = self._first_detection(fault_at)
            if self.detected is not None:
                self.echo(f"detected: {self.detected['component']} {self.detected['event']} "
                          f"after {self.detected['t'] - fault_at:.3f} s")
                if self.scenario.fault in ("stall", "stage-die"):
                    self.injection.lift()  # or the replacement worker does it too
        if self.recovered is None and (self.scenario.restarts
                                       or self.scenario.recovered_event != RECOVERED):
            self.recovered = events.first(fault_at, {self.scenario.recovered_event}, te)
            if self.recovered is not None:
                self.echo(f"recovered: {self.recovered['component']} after "
                          f"{self.recovered['t'] - fault_at:.3f} s")
        if self.gave_up is None:
            self.gave_up = events.first(fault_at, {"failed"}, te)
            if self.gave_up is not None:
                self.echo(f"the supervisor gave up on {self.gave_up['component']}")

    def _first_detection(self, fault_at: float) -> dict | None:
        """The first fault the supervisor saw in the target TE (poison: in any
        TE it was injected into: the request of death may land on either)."""
        if self.scenario.kills_head:  # the standby heard nothing from the head
            return self.events.first(fault_at, {"head_lost"}, None)
        if self.scenario.kills_node:  # the cluster manager drops the node's TEs
            tes = set(self.injection.components)
            return self.events.first_where(fault_at, lambda e: e.get("event") == TE_REMOVED
                                           and (e.get("details") or {}).get("te_id") in tes)
        if self.poison is None:
            return self.events.first(fault_at, self.scenario.detect_events,
                                     None if self.scenario.detect_anywhere else self.te)
        tes = {te_of(c) for c in self.injection.components}
        return self.events.first_where(fault_at, lambda e: e.get("event") in DETECT_EVENTS
                                       and te_of(str(e.get("component", ""))) in tes)

    def _has_recovered(self, t: float, fault_at: float) -> bool:
        s, inj = self.scenario, self.injection
        if self.poison is not None:  # and the node whole again: the last restart may be
            # logged seconds after the TE left the list (its host saw the crash first)
            want = len(self.config.tes) if self.config is not None else 1
            return (has_recovered(self.events, self.poison, fault_at, self.records())
                    and (num_tes(self.url) or 0) >= want)
        if s.kills_node or s.served_again:  # served after the detection (by the other
            # node; by the gateway that listens again)
            return self.detected is not None and first_success_after(
                self.records(), self.detected["t"]) is not None
        if s.restarts:
            return self.recovered is not None or self.gave_up is not None
        if s.hold_s:  # slow: lift after hold_s, then one success after
            if inj.lifted_at is None and t >= fault_at + s.hold_s:
                inj.lift()
                inj.lifted_at = inj.lifted_at or t
            return (inj.lifted_at is not None
                    and first_success_after(self.records(), inj.lifted_at) is not None
                    and (s.recovered_event == RECOVERED or self.recovered is not None))
        # one-shot hooks: consumed, then one success after that
        if self.consumed_at is None and inj.hook_consumed():
            self.consumed_at = t
        return (self.consumed_at is not None
                and first_success_after(self.records(), self.consumed_at) is not None)

    # -- the verdict --------------------------------------------------------------------
    def _report(self, records: list[RequestRecord], fault_at: float) -> DrillReport:
        detected_at, recovered_at = self.outcome(records, fault_at)
        proven = self.proof.is_proven
        report = build_report(self.scenario.name, records, self.reference, self.deadline_s,
                              fault_at, detected_at, recovered_at, fault_proven=proven,
                              proof="; ".join(self.proof.evidence) if proven
                              else self.proof.failure)
        report.details.update(self._details(records, fault_at))
        if self.poison is not None:
            report.details["poison"] = summary(self.events, self.poison, fault_at, records)
        return report

    def outcome(self, records: list[RequestRecord], fault_at: float, last_look: bool = True
                ) -> tuple[float | None, float | None]:
        """The last look, after the load ended: (detected_at, recovered_at),
        epoch seconds or None; the proof finished (proof.is_proven, .evidence,
        .failure say how it went). last_look=False: a detection counts only if
        poll() saw it (chaos: a later fault's detection on the same TE is not
        this one's)."""
        if self.detected is None and last_look:  # logged while the load drained
            self.detected = self._first_detection(fault_at)
        if (self.scenario.kills_node or self.scenario.served_again) \
                and self.detected is not None:
            recovered_at = first_success_after(records, self.detected["t"])
        elif self.scenario.restarts:
            if self.recovered is None:
                self.recovered = self.events.first(fault_at, {self.scenario.recovered_event},
                                                   self.te)
            recovered_at = self.recovered["t"] if self.recovered is not None else None
        elif self.poison is not None:  # every restarted TE back, then a success (poison.py)
            recovered_at = self.done_at
        elif self.scenario.recovered_event != RECOVERED:  # disk-full: the tier back on
            recovered_at = self.recovered["t"] if self.recovered is not None else None
        else:
            recovered_at = first_success_after(records, fault_at)
        self.proof.finish(records)
        return self.detected["t"] if self.detected else None, recovered_at

    def _details(self, records: list[RequestRecord], fault_at: float) -> dict:
        inj, detected = self.injection, self.detected
        return dict(
            te=self.te, component=inj.component, components=inj.components, pid=inj.pid,
            hooks=[str(h) for h in inj.hooks], evidence=self.proof.evidence,
            detected_event=detected and {k: detected.get(k) for k in ("component", "event",
                                                                         "time")},
            recovered_event=self.recovered is not None, gave_up=self.gave_up is not None,
            hook_consumed=self.consumed_at is not None, notes=inj.notes,
            completed_after_fault=sum(1 for r in records
                                      if r.status == COMPLETED and r.start > fault_at),
            no_service_s=_since(first_success_after(records, fault_at), fault_at),
            restarts=[e.get("component") for e in self.events.events(fault_at)
                      if e.get("event") == "restarting"],
            timeline=[f"+{e['t'] - fault_at:.3f} {e.get('component')} {e.get('event')} "
                      f"pid={e.get('pid')} {json.dumps(e.get('details') or {})}"
                      for e in self.events.events(fault_at)])


def _since(t: float | None, fault_at: float) -> float | None:
    """Seconds from the fault to t (no_service_s: to the first token of a request
    sent after the fault); None: never."""
    return None if t is None else round(t - fault_at, 3)
