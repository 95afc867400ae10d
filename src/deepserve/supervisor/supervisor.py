"""The supervisor: watch a node's processes, replace what fails, log it all.

    every watched process ──Heartbeat / Ready / HealthEvent──> [inbox PULL, bound]
                                                                    │
    ProcessTable.poll() of every child ──> exited?           Watchdog.check()
                                  │                                 │ crashed, heartbeat_missed,
                                  └──────────────┬──────────────────┘ hung, oom
                                                 ▼
      TE fault: TEDown to the CM [PUSH] at once (the JE resumes its requests elsewhere),
                SIGKILL the faulty process, stop the TE's host and its children,
                RestartPolicy: restart after a backoff, or give up (crash loop)
      CM PUB ──TEList──> [SUB] a restarted TE is back (it served its warm-up) ──> recovered
                                                 ▼
                                     health.jsonl (HealthLog)

It knows no node: it acts through a ProcessTable (start, stop, respawn,
sweep, poll), writes a HealthLog, and is told which names are TEs and which
node-level processes beat from their start (`watched`).

The restart unit of a TE is the whole TE (host, tokenizer, master, workers):
its processes share a KV pool and a step ring, so one of them alone cannot be
replaced. A TE's internal processes ("te0/worker0") are watched from their
first heartbeat on; a restarted TE's from the first one whose pid descends
from the TE's new host (a late message of the old incarnation's does not),
so a fault before the TE is listed again (a worker stalled in its warm-up)
is judged as any other and restarts it again;
the `watched` node-level processes (gateway, job executor, cluster manager)
from their spawn, with the startup grace; every child of the table also by
its exit. One thread runs all of this (`run`),
ticking every `tick_s`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Container, Iterable

import msgspec
import psutil
import zmq

from deepserve.ipc import curve
from deepserve.ipc.sockets import PullSocket, PushSocket, SubSocket
from deepserve.messages.control import FromClusterManager, TEDown, TEList, TermFence
from deepserve.messages.health import HealthEvent, Heartbeat, Ready, ToSupervisor
from deepserve.messages.scaling import NODE_REPORT_S, ScaleIn, ScaleOut
from deepserve.supervisor.head_watch import HeadWatch
from deepserve.supervisor.health_log import EVENTS, HealthLog
from deepserve.supervisor.process_table import ProcessTable
from deepserve.supervisor.restart_policy import GIVE_UP, GONE, RestartPolicy
from deepserve.supervisor.watchdog import ComponentSpec, Fault, Watchdog

log = logging.getLogger(__name__)

NODE_PROCESSES = ("job-executor", "cluster-manager", "gateway", "kv-cache")
"""The node-level processes that beat: watched from their spawn."""


@dataclass
class _Incident:
    fault_at: float  # time.monotonic() of the detection
    restart_at: float | None = None  # set once its processes are gone
    restarted: bool = False
    delay_s: float = 0.0


class Supervisor:
    """table: the children to watch and act on; tes: the names in it that are
    TEs (anything with `in`; read at every fault); inbox: the address to bind
    for heartbeats; cm_pub / cm: the cluster manager's PUB (TEList) and inbox
    (TEDown); cfg: a SupervisorConfig (deadlines, restart budget, kill grace);
    node_inbox: a joined node's tcp inbox for the head's ScaleOut / ScaleIn ("": none);
    head_watch: a standby head's HeadWatch, fed with what the CM's PUB says;
    with a scaler, a NodeReport goes to the CM every NODE_REPORT_S."""

    def __init__(self, table: ProcessTable, health: HealthLog, cfg, *, tes: Container[str],
                 inbox: str, cm_pub: str, cm: str, watched: Iterable[str] = NODE_PROCESSES,
                 tick_s: float = 0.1, scaler=None, te_address=lambda te_id: "",
                 node_inbox: str = "", head_watch: HeadWatch | None = None, term: int = 0):
        self.table, self.health, self.cfg, self.tick_s = table, health, cfg, tick_s
        self.tes, self.watched = tes, tuple(watched)
        self.watchdog = Watchdog()
        self.policy = RestartPolicy(cfg.restart_base_delay_s, cfg.restart_max_delay_s,
                                    max_restarts=cfg.max_restarts,
                                    window_s=cfg.restart_window_s)
        self.ctx = zmq.Context()
        self.inbox = PullSocket(self.ctx, inbox, bind=True, type=ToSupervisor)
        self.inboxes = [self.inbox]
        if node_inbox:  # only orders cross hosts: heartbeats stay on the host's ipc inbox
            self.inboxes.append(PullSocket(self.ctx, node_inbox, bind=True,  # a head's only
                                           type=ScaleOut | ScaleIn, admit=curve.from_head))
        self.reported_at = -NODE_REPORT_S
        self.cm_pub = SubSocket(self.ctx, cm_pub, bind=False, type=FromClusterManager)
        self.to_cm = PushSocket(self.ctx, cm, bind=False)
        self.incidents: dict[str, _Incident] = {}  # component (a TE id or a process) ->
        self.failed: set[str] = set()
        self.tes_listed: set[str] = set()
        self.scaler = scaler  # scaler.py (None: a fixed set of TEs, no pool)
        self.te_address = te_address  # te id -> its inbox (TEDown names it: ours, no namesake)
        self.head_watch = head_watch  # a standby head's (head_watch.py): when to take over
        self.fence = TermFence(term)  # the highest head term heard (head_terms.py)
        self.retired: set[str] = set()  # stopped for good on purpose: a deposed head's CM, JE
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        for name in self.watched:
            if name in self.table:
                self._watch(name, self.table.pid(name), self.cfg.startup_grace_s)
        self._thread = threading.Thread(target=self.run, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for sock in (*self.inboxes, self.cm_pub, self.to_cm):
            sock.close()
        self.ctx.term()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick(time.monotonic())
            except Exception:  # the supervisor must outlive any one bad tick
                log.exception("supervisor tick failed")
            self._stop.wait(self.tick_s)

    # -- one tick ------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for inbox in self.inboxes:
            for msg in inbox.drain():
                if isinstance(msg, (ScaleOut, ScaleIn)) and msg.term < self.fence.highest:
                    self._log("node", "scale_refused", None, model=msg.model, term=msg.term,
                              reason=f"a deposed head's order (term {msg.term} < "
                                     f"{self.fence.highest})")
                elif self.scaler is None or not self.scaler.on_message(msg, now):
                    self._on_message(msg, now)
        if self.scaler is not None:
            self.scaler.tick(now)
            if now - self.reported_at >= NODE_REPORT_S:
                self.reported_at = now
                self._send_cm(msgspec.structs.replace(self.scaler.report(),
                                                      term=self.fence.highest))
        heard = [msg for msg in self.cm_pub.drain() if self.fence.admits(msg)]
        if self.head_watch is not None:
            if heard:
                self.head_watch.heard(now)
            self.head_watch.check(now)
        for msg in heard:
            if isinstance(msg, TEList) and msg.is_complete:  # else: a CM's sign of life
                self._on_te_list({te.te_id for te in msg.tes}, now)
        if self.scaler is not None:  # a TE stopped for scale-in is not watched
            for component in self.watchdog.names:
                owner = component.split("/")[0]
                if self.scaler.is_retiring(owner) or owner not in self.table:
                    self.watchdog.remove(component)
        for fault in self.watchdog.check(now):
            self._on_fault(fault, now)
        for name, popen in self.table.procs.items():
            incident = self.incidents.get(name)
            if popen.poll() is None or name in self.failed or name in self.retired \
                    or (incident and not incident.restarted):
                continue  # alive, given up on, or already being replaced
            if self.scaler is not None and (name in self.scaler.pods
                                            or self.scaler.is_retiring(name)
                                            or self.scaler.is_waiting(name)):
                continue  # the pool replaces its processes; a retiring TE is meant to
                # stop; a TE waiting for a warming pod is still its dead old process
            self._log(name, "crashed", popen.pid, exit_code=popen.returncode,
                      while_recovering=incident is not None)
            self._fail(name, now, popen.pid, part="host")
        for name, incident in list(self.incidents.items()):
            if not incident.restarted and incident.restart_at is not None \
                    and now >= incident.restart_at:
                self._restart(name, incident)

    def _send_cm(self, msg) -> None:
        try:
            self.to_cm.put(msg, timeout=0.05)
        except TimeoutError:  # a CM being replaced: the next report goes out in a second
            pass

    def _on_message(self, msg, now: float) -> None:
        if not isinstance(msg, (Heartbeat, Ready, HealthEvent)):
            return  # ScaleOut / ScaleIn without a scaler: nothing to scale
        if isinstance(msg, HealthEvent):
            if msg.event not in EVENTS:  # a bug in the sender: never lose the tick for it
                log.warning("%s[%d] sent unknown health event %r: dropped", msg.component,
                            msg.pid, msg.event)
                return
            self._log(msg.component, msg.event, msg.pid, **msg.details)
            if msg.event == "head_stepped_down" and msg.component == "cluster-manager":
                self._retire(("cluster-manager", "job-executor"))
            return
        owner = msg.component.split("/")[0]
        if owner in self.failed or owner not in self.table \
                or (self.scaler is not None and self.scaler.is_retiring(owner)):
            return  # a TE given up on or retired, or no child of ours
        if owner in self.incidents and not self._is_restarted_process(owner, msg.pid):
            return  # a late message from a TE being replaced
        if msg.component not in self.watchdog or self.watchdog.pid_of(msg.component) != msg.pid:
            if "/" not in msg.component:
                return  # node-level processes are registered when spawned
            # It beats, so it has started: its deadlines apply from now on (its
            # Ready may have been sent before the supervisor could hear it).
            self._watch(msg.component, msg.pid, 0.0)
            self._log(msg.component, "started", msg.pid)
        if isinstance(msg, (Heartbeat, Ready)):
            self.watchdog.on_message(msg, now)

    def _is_restarted_process(self, owner: str, pid: int) -> bool:
        """pid is the restarted `owner`'s process or one of its descendants: a
        new incarnation's (the old one's were stopped before the restart, and
        a pid reused since is no descendant), so it is watched before the TE
        is listed again: a worker that stalls in its warm-up is found hung."""
        incident = self.incidents[owner]
        if not incident.restarted:
            return False
        host = self.table.pid(owner)
        try:
            return pid == host or any(p.pid == host for p in psutil.Process(pid).parents())
        except psutil.Error:
            return False

    def _on_te_list(self, listed: set[str], now: float) -> None:
        if self.scaler is not None:
            self.scaler.on_te_list(listed, now)
        for te_id in listed - self.tes_listed:
            incident = self.incidents.get(te_id)
            if incident is not None and incident.restarted:
                del self.incidents[te_id]
                self.policy.on_recovered(te_id, now)
                self._log(te_id, "recovered", self.table.pid(te_id),
                          recover_s=round(now - incident.fault_at, 3))
        self.tes_listed = listed

    def _on_fault(self, fault: Fault, now: float) -> None:
        owner = fault.component.split("/")[0]
        incident = self.incidents.get(owner)
        if owner in self.failed or (incident is not None and not incident.restarted):
            return  # given up on, or its processes are being stopped already
        self._log(fault.component, fault.kind, fault.pid, latency_s=round(fault.latency_s, 3),
                  **fault.detail)
        self._fail(owner, now, fault.pid, part=fault.component.partition("/")[2] or "host")

    def watch_process(self, name: str) -> None:
        """Watch a node-level process started after start() (a standby head's
        cluster manager and job executor once it takes over)."""
        if name not in self.watched:
            self.watched = (*self.watched, name)
        self._watch(name, self.table.pid(name), self.cfg.startup_grace_s)

    # -- acting ------------------------------------------------------------------------
    def _retire(self, names: tuple[str, ...]) -> None:
        """Stop `names` for good, not as a fault: a deposed head's cluster manager
        and job executor (they are neither restarted nor counted as failed)."""
        names = tuple(n for n in names if n in self.table and n not in self.retired)
        self.retired.update(names)
        for name in names:
            if name in self.watchdog.names:
                self.watchdog.remove(name)
        threading.Thread(target=lambda: [self.table.stop(n, self.cfg.kill_grace_s)
                                         for n in names], name="retire", daemon=True).start()

    def _fail(self, name: str, now: float, faulty_pid: int | None, part: str = "") -> None:
        """Take `name` (a TE or a node process) down and schedule its restart;
        part: which of a TE's processes failed (TEDown.part)."""
        incident = self.incidents[name] = _Incident(now)
        if name in self.tes:
            try:
                self.to_cm.put(TEDown(te_id=name, reason=f"supervisor: {part or 'process'} fault",
                                      address=self.te_address(name), part=part), timeout=1)
            except TimeoutError:  # no CM (it is being replaced): its TE timeout drops the TE
                log.warning("TEDown %s: the cluster manager does not listen", name)
        pid = self.table.pid(name)
        if faulty_pid is not None and faulty_pid != pid:
            _sigkill(faulty_pid)  # the stuck one first: SIGTERM cannot stop a stopped process
        for component in [c for c in self.watchdog.names if c.split("/")[0] == name]:
            self.watchdog.remove(component)
        decision = self.policy.on_failure(name, now)
        if decision.action == GIVE_UP:
            del self.incidents[name]
            self.failed.add(name)
            if self.scaler is not None:
                self.scaler.forget(name)
            self._log(name, "failed", None, attempts=decision.attempt,
                      reason=f"{self.cfg.max_restarts} restarts within "
                             f"{self.cfg.restart_window_s:g} s: crash loop, left down")
        else:
            incident.delay_s = decision.delay_s
            self._log(name, "restarting", None, delay_s=round(decision.delay_s, 3),
                      attempt=decision.attempt)
        # Stopping the rest may take the kill grace: not on this thread, which
        # must keep reading heartbeats and events meanwhile.
        threading.Thread(target=self._stop_processes, args=(name, pid, incident),
                         name=f"stop-{name}", daemon=True).start()

    def _stop_processes(self, name: str, pid: int, incident: _Incident) -> None:
        outcome = self.table.stop(name, self.cfg.kill_grace_s)
        swept = self.table.sweep(name)  # a killed TE could not unlink its shared memory
        if outcome != GONE:
            self._log(name, "killed", pid, how=outcome, segments_swept=len(swept))
        incident.restart_at = time.monotonic() + incident.delay_s

    def _restart(self, name: str, incident: _Incident) -> None:
        if self.scaler is not None and name in self.tes \
                and self.scaler.replace(name, time.monotonic()):
            popen = self.table.procs[name]  # a pre-warmed process, now or once one is ready
        else:
            popen = self.table.respawn(name)
        incident.restarted = True
        if name in self.watched:
            self._watch(name, popen.pid, self.cfg.startup_grace_s)
        if name not in self.tes:
            del self.incidents[name]  # no warm-up to wait for

    def _watch(self, name: str, pid: int, grace_s: float) -> None:
        c = self.cfg
        memory = None if c.memory_limit_mb is None else int(c.memory_limit_mb * (1 << 20))
        self.watchdog.add(ComponentSpec(name, pid, c.heartbeat_deadline_s, c.progress_deadline_s,
                                        memory, grace_s))

    def _log(self, component: str, event: str, pid: int | None, **details) -> None:
        self.health.write(component, event, pid=pid, **details)


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
