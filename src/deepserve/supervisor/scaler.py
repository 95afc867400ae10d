"""The node's side of scaling: the pre-warmed pool, and carrying out the
cluster manager's ScaleOut / ScaleIn (messages/scaling.py).

    CM autoscaler ──ScaleOut(model, n)──> supervisor inbox ──> NodeScaler.scale_out
        a ready pre-warmed process?  yes: adopt it as the new TE, Assign ──> it loads the model
                                     no:  start a cold TE process
        TE Ready (its stages) ... TE in the CM's TE list ──> scaled_out (health log)
                                                         ──> ScaleEvent ──> CM ──> /metrics
    CM ──ScaleIn(te_id)──> stop it (SIGTERM; drained first by the CM) ──> scaled_in
    supervisor restarting a crashed TE ──> replace(): from the pool too (same path)
    every NODE_REPORT_S ──report()──> NodeReport ──> CM (placement: control/cm/hosts.py)

Many hosts: the head's CM places each scaled TE on a node (its own, or a
joined one). A joined node declares no [[model]]: a ScaleOut carries the
model's path and options, and the node learns the model from it
(Node.model_spec; node_models.py, which also caches its weights). Its scaled TEs are named after the node
(h1-tiny-0) and bind tcp inboxes after its [[te]] ones. A ScaleOut for more
TEs than the node's free devices ([node] num_devices minus every TE's tp)
starts what fits; each TE refused is a ScaleEvent "failed" (the CM's slot
frees at once). A model whose directory is not on this host is forked: its
files are pulled from a peer the ScaleOut names (`sources`) on a thread of
its own, and the TEs start once they are here (the `fork` stage); a fork no
source could give refuses the TEs.

The pool keeps [scaling] pool_size processes started (`te_server --pool`,
prewarmed.py), each Ready once warm; it refills in the background (a pod
taken is replaced once no TE is starting: a pod's imports would slow the
start it waits for on 2 cores). A dead pod is replaced after a backoff, and
a pool whose pods keep dying is given up for good (pool_gave_up; TEs start
cold): the TEs' restart budget, pool_backoff.py. Pods are children of the
node, in its ProcessTable, never restarted by the supervisor: the pool
replaces them. The weight cache (cache/weight_cache.py) is filled here,
for every model, in the order models are used, within its budget.

Thread rule: everything runs on the supervisor's thread (its tick), except
the stop of a retiring TE and a fork, which run on threads of their own and
only set a flag or a result.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import psutil

from deepserve.ipc.outboxes import Outboxes
from deepserve.messages.health import Ready
from deepserve.messages.scaling import (Assign, NodeReport, ScaleEvent, ScaleIn, ScaleOut,
                                        StaticTE)
from deepserve.supervisor.pool_backoff import PoolBackoff

log = logging.getLogger(__name__)
POOL_PREFIX = "pool"


@dataclass
class _Start:
    model: str
    reason: str
    source: str
    decided_at: float
    given_at: float | None  # a process was given the TE (Assign sent, or cold Popen)
    ready_at: float | None = None  # the TE's own clock (Ready.time): same node, same clock
    listed_at: float | None = None
    stages: dict = field(default_factory=dict)
    weights: str = "disk"
    fork_s: float | None = None  # the weights were forked from a peer first (seconds)
    pod_address: str | None = None  # the adopted pod's inbox, until it answers as the TE


POD_WAIT_S = 60.0
"""A start waits at most this long for a warming pre-warmed process (then: cold)."""
MAX_SCALE_OUT = 64
"""TEs one ScaleOut starts at most (a model's max_tes is at most 64): a bad count
from the wire cannot make a node fork without bound."""
READY_WAIT_S = 2.0
"""A TE listed before its Ready came in: scaled_out waits this long for its stages."""


class NodeScaler:
    """node: the Node (its table, health log, config, run, te_ids, and how it
    spawns children); to_cm(msg): send to the CM's inbox."""

    def __init__(self, node, to_cm, clock=time.monotonic):
        self.node, self.to_cm, self.clock = node, to_cm, clock
        self.config = node.config
        self.pool_size = self.config.scaling.pool_size
        self.pods: dict[str, bool] = {}  # pod name -> ready
        self.backoff = PoolBackoff(self.config.supervisor, node.health)  # dead pods' respawns
        self.num_pods = 0
        self.next_index = {m.name: m.min_tes for m in self.config.models}
        self.starting: dict[str, _Start] = {}  # te id -> its scale-out, until listed
        self.retiring: dict[str, float] = {}  # te id -> when it was told to stop
        self.stopped: set[str] = set()  # retiring TEs whose processes are gone (stop thread)
        self.static = {te.te_id for te in self.config.tes}
        self.model_of: dict[str, str] = {te_id: self.config.node.served_model
                                         for te_id in self.static}
        self.model_of.update(self.config.initial_scaled_tes())
        self.scaled: dict[str, str] = {}  # scaled TE id -> model, from its start until it is gone
        self.taken = 0  # ScaleOut TEs received (NodeReport.scale_outs)
        self.forking: dict[str, list[tuple]] = {}  # model path -> scale-outs waiting for it
        self.forked: dict[str, object] = {}  # model path -> its fork's Forked or error (thread)
        self.assigns = Outboxes(node.ctx)

    # -- the pool ------------------------------------------------------------------
    def fill_pool(self, now: float | None = None) -> None:
        """Drop dead pods (each a death for the backoff), then spawn up to
        pool_size: not while a TE starts (TE starts go first), a backoff runs,
        or once the pool is given up. An adopted pod left self.pods alive."""
        now = self.clock() if now is None else now
        for name in [p for p in self.pods if self.node.table.poll(p) is not None]:
            self.backoff.on_death(name, self.node.table.poll(name), now)
            self.node.table.remove(name)
            del self.pods[name]
        while len(self.pods) < self.pool_size and not self.starting \
                and self.backoff.may_spawn(now):
            name = f"{POOL_PREFIX}{self.num_pods}"
            self.num_pods += 1
            self.pods[name] = False
            self.node.spawn_pod(name)

    # -- messages -------------------------------------------------------------------
    def on_message(self, msg, now: float) -> bool:
        """Handle what is the scaler's (True), or leave it to the supervisor."""
        if isinstance(msg, ScaleOut):
            self.taken += msg.count
            self.scale_out(msg.model, max(0, min(msg.count, MAX_SCALE_OUT)), msg.reason,
                           msg.decided_at if 0 < msg.decided_at <= now else now,
                           path=msg.path, options=msg.options, sources=msg.sources)
        elif isinstance(msg, ScaleIn):
            self.scale_in(msg.te_id, msg.reason, now)
        elif isinstance(msg, Ready) and msg.component in self.pods:
            self.pods[msg.component] = True
            self.node.health.write(msg.component, "pool_ready", msg.pid, **msg.details)
        elif isinstance(msg, Ready) and msg.component in self.starting:
            start = self.starting[msg.component]
            self._forget_pod(start)  # it took its Assign: nothing goes to that inbox again
            start.ready_at = msg.time if 0 < msg.time <= now else now
            start.stages = dict(msg.details.get("stages", {}))
            start.weights = msg.details.get("weights", "disk")
            if start.listed_at is not None:
                self._scaled_out(msg.component, start.listed_at)
            return False  # the supervisor watches it from here, as any TE
        else:
            return False
        return True

    # -- scaling out -------------------------------------------------------------------
    def scale_out(self, model: str, count: int, reason: str, now: float, path: str = "",
                  options: dict | None = None, sources=(), fork_s: float | None = None) -> None:
        spec = self.node.model_spec(model, path, options or {})
        if spec is None and path and sources and not self.node.models.holds(path):
            self._fork(path, list(sources), (model, count, reason, now, options))
            return
        if spec is None:
            log.error("scale-out of model %r refused: unknown, or not on this host", model)
        fits = 0 if spec is None else self.fits(spec, count)
        for _ in range(fits):
            te_id = self.node.scaled_te_id(spec, self.next_index.get(model, 0))
            self.next_index[model] = self.next_index.get(model, 0) + 1
            self.start_te(te_id, model, reason, now, fork_s)
        why = ("unknown model" if not path else "no model files here and no peer has them") \
            if spec is None else "no free devices"
        self._refuse(model, count - fits, why)

    def _refuse(self, model: str, count: int, why: str) -> None:
        for _ in range(count):
            self.node.health.write(model, "scale_refused", None, reason=why)
            self._tell_cm(ScaleEvent(model=model, te_id="", direction="failed", reason=why))

    def _fork(self, path: str, sources: list[str], order: tuple) -> None:
        """Pull model `path` from a peer on a thread; `order` (a scale-out) waits for it."""
        waiting = self.forking.setdefault(path, [])
        waiting.append(order)
        if len(waiting) > 1:
            return  # one fork per model: the later orders wait for the same one

        def run() -> None:
            try:
                self.forked[path] = self.node.models.fork(path, sources)
            except Exception as e:  # noqa: BLE001 - ForkError, OSError: the orders are refused
                self.forked[path] = e
        threading.Thread(target=run, name="fork", daemon=True).start()

    def _forks_done(self) -> None:
        """Scale-outs whose fork ended: started from the copy, or refused."""
        for path in [p for p in self.forking if p in self.forked]:
            result, orders = self.forked.pop(path), self.forking.pop(path)
            if isinstance(result, Exception):
                log.error("fork of %s failed: %s", path, result)
                self.node.health.write(path, "fork_failed", None, error=str(result))
                for model, count, *_ in orders:
                    self._refuse(model, count, f"fork failed: {result}")
                continue
            self.node.health.write(path, "weights_forked", None, source=result.source,
                                   bytes=result.bytes, seconds=round(result.seconds, 3))
            for model, count, reason, decided, options in orders:
                self.scale_out(model, count, reason, decided, path, options,
                               fork_s=round(result.seconds, 4))

    def fits(self, spec, count: int) -> int:
        """How many of `count` TEs of spec the node's free devices take."""
        free = self.free_devices()
        return count if free is None else min(count, free // max(1, _tp(spec)))

    def free_devices(self) -> int | None:
        total = self.config.node.num_devices
        if total is None:
            return None
        used = sum(g.num_devices for g in self.node.placed)
        used += sum(_tp(self.node.model_spec(m)) for m in self.scaled.values())
        used += sum(count * int((options or {}).get("tp", 1))  # forking: started once here
                    for orders in self.forking.values() for _, count, _, _, options in orders)
        return max(0, total - used)

    def report(self) -> NodeReport:
        """This node's capacity, for the CM's placement."""
        cached, serves = self.node.models.holdings()
        return NodeReport(node=self.config.cluster.name, run_id=self.node.run_id,
                          address=self.node.run.node_inbox or self.node.run.hb,
                          free_devices=self.free_devices(),
                          available_bytes=psutil.virtual_memory().available,
                          ready_pods=sum(1 for p, ready in self.pods.items()
                                         if ready and self.node.table.poll(p) is None),
                          cached=cached, weights=self.node.run.weights, serves=serves,
                          tes=dict(self.scaled), static=self.static_tes(),
                          scale_outs=self.taken)

    def static_tes(self) -> list[StaticTE]:
        """The node's [[te]] TEs that run here (placed: not evicted or refused)."""
        node = self.config.node
        return [StaticTE(te.te_id, node.served_model, node.model, te.te_type)
                for te in self.config.tes if te.te_id in self.node.te_ids]

    def start_te(self, te_id: str, model: str, reason: str, now: float,
                 fork_s: float | None = None) -> None:
        """Start (or restart) te_id: from a pre-warmed process if one is ready;
        else, if one is still warming, as soon as it is (it has a head start on
        a cold process, and a cold start beside it would slow both on few
        cores); else cold."""
        if te_id not in self.node.te_ids:
            self.node.te_ids.append(te_id)
        self.model_of[te_id] = model
        if te_id not in self.static:  # a [[te]] TE's devices are the node's placement's
            self.scaled[te_id] = model
            self.node.bind_te(te_id)
        self.starting[te_id] = _Start(model, reason, "", now, None, fork_s=fork_s)
        waiting = [t for t, st in self.starting.items() if st.given_at is None]
        if self._ready_pod() is None and len(waiting) <= self._num_warming():
            return  # given in tick() once a pod is ready (POD_WAIT_S at most)
        self._give(te_id)

    def _give(self, te_id: str) -> None:
        start = self.starting[te_id]
        pod = self._ready_pod()
        if pod is not None:
            del self.pods[pod]
            incarnation = self.node.table.next_incarnation(te_id)
            self.node.adopt_pod(pod, te_id, start.model)
            start.pod_address = self.node.run.te_address(pod)
            self.assigns.put(start.pod_address, Assign(
                te_id=te_id, model=start.model, run_id=self.node.te_run_id(te_id, incarnation),
                sent_at=time.monotonic()))
            start.source = "prewarmed"
        else:
            self.node.spawn_te(te_id, start.model)
            start.source = "cold"
        start.given_at = self.clock()

    def _ready_pod(self) -> str | None:
        return next((p for p, ready in self.pods.items()
                     if ready and self.node.table.poll(p) is None), None)

    def _num_warming(self) -> int:
        return sum(1 for p, ready in self.pods.items()
                   if not ready and self.node.table.poll(p) is None)

    def _give_waiting(self, now: float) -> None:
        """Starts waiting for a pod: given one as pods get ready; cold once
        no pod is left warming for them, or after POD_WAIT_S."""
        waiting = [t for t, st in self.starting.items() if st.given_at is None]
        for i, te_id in enumerate(waiting):
            if self._ready_pod() is not None or i >= self._num_warming() \
                    or now - self.starting[te_id].decided_at > POD_WAIT_S:
                self._give(te_id)

    def is_waiting(self, te_id: str) -> bool:
        """A (re)start of te_id waits for a pod: its previous process stays dead meanwhile."""
        start = self.starting.get(te_id)
        return start is not None and start.given_at is None

    def replace(self, te_id: str, now: float) -> bool:
        """Restart a failed TE from the pool (True: now, or once a warming pod
        is ready), or leave it to respawn cold (False: no pod at all)."""
        model = self.model_of.get(te_id)
        if model is None or self._ready_pod() is None and not self._num_warming():
            return False
        self.start_te(te_id, model, "replace", now)
        return True

    def on_te_list(self, listed: set[str], now: float) -> None:
        for te_id in [t for t in self.starting if t in listed]:
            start = self.starting[te_id]
            if start.listed_at is None:
                start.listed_at = now
            if start.ready_at is not None or now - start.listed_at >= READY_WAIT_S:
                self._scaled_out(te_id, start.listed_at)

    def _forget_pod(self, start: _Start) -> None:
        """Close the PUSH to an adopted pod's inbox (one socket per pod otherwise
        stays open for the node's life: an fd per replaced TE)."""
        if start.pod_address is not None:
            self.assigns.forget(start.pod_address)
            start.pod_address = None

    def _scaled_out(self, te_id: str, now: float) -> None:
        """Log and tell the CM: te_id is listed (at `now`), every stage timed."""
        start = self.starting.pop(te_id, None)
        if start is not None:
            self._forget_pod(start)
            ready_at = start.ready_at if start.ready_at is not None else now
            given_at = start.given_at if start.given_at is not None else start.decided_at
            fork = {} if start.fork_s is None else {"fork": start.fork_s}
            stages = {**fork, "scaler_pre": round(given_at - start.decided_at
                                                  - (start.fork_s or 0.0), 4),
                      **start.stages, "scaler_post": round(now - ready_at, 4)}
            source = start.source + ("_cache" if start.weights == "cache" and
                                     start.source == "prewarmed" else "")
            weights = "fork" if start.fork_s is not None else start.weights
            total = round(now - start.decided_at, 4)
            self.node.health.write(te_id, "scaled_out", self.node.table.pid(te_id),
                                   model=start.model, reason=start.reason, source=source,
                                   weights=weights, total_s=total, stages=stages)
            self._tell_cm(ScaleEvent(model=start.model, te_id=te_id, direction="out",
                                     source=source, reason=start.reason, stages=stages,
                                     total_s=total))

    def forget(self, te_id: str) -> None:
        """A start that failed for good (the supervisor gave up on it)."""
        self.scaled.pop(te_id, None)
        start = self.starting.pop(te_id, None)
        if start is not None:
            self._forget_pod(start)
            self._tell_cm(ScaleEvent(model=start.model, te_id=te_id, direction="failed",
                                     source=start.source, reason=start.reason))

    # -- scaling in ---------------------------------------------------------------------
    def scale_in(self, te_id: str, reason: str, now: float) -> None:
        """Stop a scaled TE (a [[te]] TE, or no TE of ours: ignored, whoever asks)."""
        if te_id not in self.scaled or te_id not in self.node.table or te_id in self.retiring:
            return
        self.retiring[te_id] = now
        start = self.starting.pop(te_id, None)
        if start is not None:
            self._forget_pod(start)
        threading.Thread(target=self._stop, args=(te_id,), name=f"retire-{te_id}",
                         daemon=True).start()

    def _stop(self, te_id: str) -> None:
        self.node.table.stop(te_id, self.config.supervisor.kill_grace_s + 5.0)
        self.node.table.sweep(te_id)
        self.stopped.add(te_id)

    def tick(self, now: float) -> None:
        self._forks_done()
        self._give_waiting(now)
        self.fill_pool(now)
        for te_id in [t for t in self.retiring if t in self.stopped]:
            began = self.retiring.pop(te_id)
            self.stopped.discard(te_id)
            model = self.model_of.get(te_id, "")
            pid = self.node.table.pid(te_id)
            self.node.table.remove(te_id)
            if te_id in self.node.te_ids:
                self.node.te_ids.remove(te_id)
            self.scaled.pop(te_id, None)
            self.node.health.write(te_id, "scaled_in", pid, model=model,
                                   stop_s=round(now - began, 3))
            self._tell_cm(ScaleEvent(model=model, te_id=te_id, direction="in"))

    def is_retiring(self, name: str) -> bool:
        return name in self.retiring

    def _tell_cm(self, msg) -> None:
        self.to_cm(msg)

    def close(self) -> None:
        self.assigns.close()


def _tp(spec) -> int:
    return int(spec.options.get("tp", 1)) if spec is not None else 1
