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

Placement (hosts.py): once nodes report (NodeReport), each TE of a
scale-out goes to the node HostBook.choose picks, with the model's path and
options (a joined node that does not declare the model serves it from them)
and the fork `sources`: the nodes holding its files, memory first, for a
node without them. The second and later nodes of one scale-out that fork
get the one before them first: a chain, each relaying its copy under way,
so no source sends the model to every node. A ScaleIn goes to the node that
runs the TE. With no node room (or no report yet: a CM that just started),
the scale-out waits (logged once: scale_unplaced). A node whose reports
stop is lost (node_lost): its TEs starting or restarting there stop
counting as capacity at once, so the autoscaler's next step starts them
elsewhere; its colocated [[te]] TEs (NodeReport.static) are started on the
other nodes at once, as scaled TEs of their model (reason replace_lost). One
host is a cluster of one node: the CM's own, which reports like any other.

A TE is drained before it is stopped, so scale-in loses nothing: the CM
lists it as draining; once DRAIN_SETTLE_S has passed (the JE has seen the
list) and its report shows nothing waiting or running, the supervisor is
told to stop it (after DRAIN_TIMEOUT_S regardless: what it still ran then
resumes elsewhere, as after a crash).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from deepserve.cache.weight_cache import model_files
from deepserve.control.cm.autoscaler import Autoscaler, Decision, ModelPolicy, ScalingOptions
from deepserve.control.cm.hosts import HostBook
from deepserve.messages.control import TEInfo, TEReport
from deepserve.messages.scaling import ModelDemand, NodeReport, ScaleEvent, ScaleIn, ScaleOut

log = logging.getLogger(__name__)
DRAIN_SETTLE_S = 1.0
DRAIN_TIMEOUT_S = 60.0


def policies_of(models: Iterable) -> list[ModelPolicy]:
    """ModelSpecs (config/models.py) of scalable models -> the autoscaler's policies."""
    return [ModelPolicy(name=m.name, min_tes=m.min_tes, max_tes=m.max_tes, idle_s=m.idle_s,
                        ttft_ms=m.slo.ttft_ms, tpot_ms=m.slo.tpot_ms,
                        percentile=m.slo.percentile) for m in models if m.scalable]


@dataclass(frozen=True)
class Target:
    """What a node needs to start a TE of a model it may not declare, and what
    placement weighs: its devices (tp) and the bytes of its weights."""

    path: str
    options: dict
    devices: int = 1
    size: int = 0


def targets_of(models: Iterable) -> dict[str, Target]:
    """ModelSpecs of scalable models -> model name -> Target."""
    return {m.name: Target(m.path, dict(m.options), int(m.options.get("tp", 1)),
                           _weights_bytes(m.path)) for m in models if m.scalable}


def _weights_bytes(path: str) -> int:
    """What a node holds of the model (the files a weight cache or a fork copies)."""
    try:
        return sum(f.stat().st_size for f in model_files(Path(path)))
    except OSError:
        return 0


def options_of(scaling) -> ScalingOptions:
    """[scaling] (ScalingSection) -> the autoscaler's options (same names)."""
    names = ScalingOptions.__dataclass_fields__
    return ScalingOptions(**{k: getattr(scaling, k) for k in names if hasattr(scaling, k)})


REPLACE = "replace_lost"
"""The reason of a scale-out that replaces a lost node's [[te]] TEs."""


class ScalingControl:
    """send(msg): to the CM's own node's supervisor; events(event, **details):
    the health log; initial: te id -> model of the TEs the node starts itself
    (min_tes); hosts / send_to(address, msg) / targets: placement over the
    nodes that report (None: every order to `send`)."""

    def __init__(self, policies: list[ModelPolicy], options: ScalingOptions,
                 send: Callable, events: Callable, now: float, startup_timeout_s: float,
                 initial: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic,
                 hosts: HostBook | None = None, send_to: Callable | None = None,
                 targets: dict[str, Target] | None = None):
        self.autoscaler = Autoscaler(policies, options, now)
        self.clock = clock
        self.models = {p.name for p in policies}
        self.send, self.events = send, events
        self.hosts, self.send_to, self.targets = hosts, send_to, targets or {}
        self.startup_timeout_s = startup_timeout_s
        self.starting: dict[str, list[tuple[float, str | None]]] = {m: [] for m in self.models}
        for model in (initial or {}).values():  # (deadline, node: None is the CM's own)
            self.starting.setdefault(model, []).append((now + startup_timeout_s, None))
        self.unplaced: set[str] = set()  # models whose scale-out found no room (logged once)
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
            self._pop_starting(info.model, self.hosts.node_of(info.te_id) if self.hosts else None)

    def on_te_down(self, te_id: str, model: str, reason: str, now: float) -> None:
        self.autoscaler.forget_te(te_id)
        self.draining.pop(te_id, None)
        if te_id in self.retiring:
            self.retiring.discard(te_id)
        elif model in self.models and reason != "shutdown" and not self._on_lost_node(te_id):
            self.restarting[te_id] = (model, now + self.startup_timeout_s)

    def on_node_report(self, report: NodeReport, now: float) -> None:
        if self.hosts is not None and self.hosts.on_report(report, now):
            log.warning("node %s joined: %s free devices, %.1f GiB available, %d ready pods",
                        report.node or "(this host)", report.free_devices,
                        report.available_bytes / (1 << 30), report.ready_pods)
            self.events("node_joined", node=report.node, run_id=report.run_id,
                        free_devices=report.free_devices, ready_pods=report.ready_pods,
                        serves=report.serves)

    def _on_lost_node(self, te_id: str) -> bool:
        """te_id ran on a node that is lost: nobody restarts it there."""
        return self.hosts is not None and self.hosts.is_lost(self.hosts.node_of(te_id) or "")

    def _node_lost(self, node: str) -> None:
        """Its starting and restarting TEs are capacity no more."""
        dropped = [t for t in self.restarting if self.hosts.node_of(t) == node]
        for te_id in dropped:
            del self.restarting[te_id]
        for model, entries in self.starting.items():
            kept = [e for e in entries if e[1] != node]
            dropped += [model] * (len(entries) - len(kept))
            entries[:] = kept
        tes = self.hosts.tes_of(node)
        log.warning("node %s lost with its TEs %s (no longer counted as starting: %s)", node,
                    tes, dropped)
        self.events("node_lost", node=node, tes=tes, dropped=dropped)
        self._replace_static(node)

    def _replace_static(self, node: str) -> None:
        """The lost node's colocated [[te]] TEs start on other nodes, placed as
        scaled ones are (their model learned or forked there from its path); a
        prefill or decode TE is not replaced (a PD pair is a layout, not a count)."""
        placed: dict[tuple[str, str, str], list[str]] = {}
        for te in self.hosts.static_of(node):
            if te.te_type != "colocated":
                continue
            to = self.hosts.choose(te.model, te.path)
            if to is None:
                log.error("no node has room for %s, a TE of lost node %s", te.te_id, node)
                self.events("scale_unplaced", model=te.model, reason=REPLACE, te_id=te.te_id,
                            nodes=self.hosts.summary())
                continue
            self.hosts.placed(to, te.model)
            placed.setdefault((to, te.model, te.path), []).append(te.te_id)
        for (to, model, path), lost in placed.items():
            self.events("scale_decision", model=model, direction="out", count=len(lost),
                        reason=REPLACE, replaces=lost, placed={to: len(lost)})
            sent = self._send(ScaleOut(model=model, count=len(lost), reason=REPLACE, path=path,
                                       sources=self.hosts.sources(path, to),
                                       decided_at=self.clock()), to)
            if sent is False:
                self.hosts.withdraw(to, model, len(lost))

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
            self._send(ScaleIn(te_id=report.te_id, model=drain[0],
                               reason="drained" if idle else "drain timeout"),
                       self.hosts.node_of(report.te_id) if self.hosts else None)

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
        if msg.direction == "failed":
            self._pop_starting(msg.model, self.hosts.node_of(msg.te_id) if self.hosts else None)

    def _pop_starting(self, model: str, node: str | None) -> None:
        """One start of `model` ended (up or failed): its slot, on `node` if one is there."""
        entries = self.starting.get(model)
        if entries:
            at = next((i for i, e in enumerate(entries) if e[1] == node), 0)
            del entries[at]

    def is_held(self, te_id: str) -> bool:
        """Draining or retiring: its TEUp must not clear the draining mark."""
        return te_id in self.draining or te_id in self.retiring

    # -- deciding ------------------------------------------------------------------
    def step(self, now: float, tes: dict[str, TEInfo]) -> list[str]:
        """Decide; send scale-outs; the TE ids that start draining now."""
        for node in self.hosts.expire(now) if self.hosts is not None else ():
            self._node_lost(node)
        for model, entries in self.starting.items():
            entries[:] = [e for e in entries if e[0] > now]
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
            if decision.direction == "out":
                self._scale_out(decision, now)
                continue
            self._log(decision)
            if decision.te_id is not None and decision.te_id in tes:
                self.draining[decision.te_id] = (decision.model, now)
                self.autoscaler.forget_te(decision.te_id)
                drained.append(decision.te_id)
        return drained

    def _scale_out(self, d: Decision, now: float) -> None:
        """Each TE to the node placement picks (one ScaleOut per node); without
        placement (hosts None), all to the CM's own node."""
        first = d.model not in self.unplaced  # retried every step while no node has room:
        per_node: dict[str | None, int] = {}  # logged when first made, and once placed
        target = self.targets.get(d.model)
        for _ in range(d.count):
            node = None
            if self.hosts is not None and target is not None:
                node = self.hosts.choose(d.model, target.path, target.devices, target.size)
                if node is None:
                    if first:
                        log.error("autoscaler: no node has room for a TE of %s", d.model)
                        self.events("scale_unplaced", model=d.model, reason=d.reason,
                                    nodes=self.hosts.summary())
                    break
                self.hosts.placed(node, d.model)
            per_node[node] = per_node.get(node, 0) + 1
        if first or per_node and d.model in self.unplaced:
            self._log(d, placed={n or "": c for n, c in per_node.items()})
        if per_node:
            self.unplaced.discard(d.model)
        else:
            self.unplaced.add(d.model)
        relay = ""  # the last node of this scale-out that forks: the next one's first source
        for node, count in per_node.items():
            extra = {}
            if target is not None:
                sources = self.hosts.sources(target.path, node) if self.hosts else []
                forks = node is not None and not self.hosts.holds(node, target.path)
                if forks and relay:  # a chain: no source sends the model to every node
                    sources = [relay, *sources]
                if forks:
                    relay = self.hosts.weights_of(node) or relay
                extra = {"path": target.path, "options": target.options, "sources": sources}
            if self._send(ScaleOut(model=d.model, count=count, reason=d.reason, inputs=d.inputs,
                                   decided_at=self.clock(), **extra), node) is not False:
                self.starting[d.model].extend([(now + self.startup_timeout_s, node)] * count)
            elif node is not None:
                self.hosts.withdraw(node, d.model, count)

    def _send(self, msg, node: str | None) -> bool | None:
        """False: the node did not take it (a scale-out then counts for nothing)."""
        address = self.hosts.address(node) if self.hosts is not None and node is not None \
            else None
        if address is not None and self.send_to is not None:
            return self.send_to(address, msg)
        return self.send(msg)

    def _log(self, d: Decision, **extra) -> None:
        """extra: placed = node -> TEs ("" the CM's own node; none: no node has room)."""
        log.warning("autoscaler: %s %s x%d (%s) %s %s", d.model, d.direction, d.count,
                    d.te_id or "", d.reason, extra or "")
        self.events("scale_decision", model=d.model, direction=d.direction, count=d.count,
                    te_id=d.te_id, reason=d.reason, inputs=d.inputs, **extra)
