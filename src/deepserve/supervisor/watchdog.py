"""The supervisor's judgement of its components: pure logic, no sockets.

    supervisor loop:  for msg in inbox.drain(): watchdog.on_message(msg)
                      for fault in watchdog.check(): log it, restart (restart_policy.py)

Time comes from an injectable clock (default time.monotonic) or the `now`
arguments; process facts (alive? RSS?) come from an injectable ProcessProbe
(default: psutil), so every rule is testable with a fake clock and fake
processes. A component's deadlines are measured on the supervisor's clock at
the moments it *receives* heartbeats, never on the sender's `time`.

Fault kinds (each is also a health_log event name) and their rules:

- crashed: the probe says the pid is gone or a zombie. Terminal: once a
  component has crashed nothing else is reported for it until it is re-added.
- heartbeat_missed: nothing is judged during startup grace, which lasts
  `startup_grace_s` after add() or until the component's Ready, whichever is
  first. Afterwards: no Heartbeat/Ready received for more than
  `heartbeat_deadline_s`, counted from the last one or from the end of grace,
  whichever is later. A warning: re-armed when a heartbeat arrives again.
- hung: per its last heartbeat the component holds work, and for more than
  `progress_deadline_s` none of its progress counters changed. The stall
  clock starts when a heartbeat shows any counter changed, or shows work
  taken (holds_work false -> true). It keeps running when heartbeats stop, so
  a SIGSTOPped process that held work is reported heartbeat_missed first and
  then hung; one that held no work is only ever heartbeat_missed (a component
  not holding work is never hung). Re-armed when the stall ends (counters move
  or work is released).
- oom: RSS of the pid (plus its descendants' if `memory_include_children`;
  default off, since each child is normally a component of its own) is above
  `memory_limit_bytes`. Reported once until re-added.

Every fault carries `detected_at` and `since`, the start of the condition as
far as the watchdog knows (hung: stall start, i.e. when progress last changed;
heartbeat_missed: last heartbeat or end of grace; crashed: last moment seen
alive; oom: last check under the limit), so `detected_at - since` bounds the
detection latency. Heartbeats whose pid differs from the spec's (a previous
incarnation's late messages) are ignored.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import psutil

from deepserve.messages.health import Heartbeat, Ready

log = logging.getLogger(__name__)

CRASHED, HEARTBEAT_MISSED, HUNG, OOM = "crashed", "heartbeat_missed", "hung", "oom"
FAULT_KINDS = (CRASHED, HEARTBEAT_MISSED, HUNG, OOM)


@dataclass(frozen=True)
class ComponentSpec:
    """One watched process. Times in seconds, on the watchdog's clock."""

    name: str
    pid: int
    heartbeat_deadline_s: float = 5.0
    progress_deadline_s: float = 30.0
    memory_limit_bytes: int | None = None
    startup_grace_s: float = 60.0
    memory_include_children: bool = False


@dataclass(frozen=True)
class Fault:
    """kind: one of FAULT_KINDS; detail: JSON-able facts for the health log."""

    component: str
    kind: str
    detail: dict
    pid: int
    detected_at: float
    since: float

    @property
    def latency_s(self) -> float:
        return self.detected_at - self.since


class ProcessProbe(Protocol):
    def is_alive(self, pid: int) -> bool: ...
    def rss_bytes(self, pid: int, include_children: bool) -> int | None: ...
    def forget(self, pid: int) -> None: ...


class PsutilProbe:
    """Reads /proc through psutil. Keeps one psutil.Process per pid, so a pid
    reused by a new process reads as the old one gone (create time differs)."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def _proc(self, pid: int) -> psutil.Process:
        proc = self._procs.get(pid)
        if proc is None:
            proc = self._procs[pid] = psutil.Process(pid)
        return proc

    def is_alive(self, pid: int) -> bool:
        try:
            proc = self._proc(pid)
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True  # cannot tell; other checks still apply

    def rss_bytes(self, pid: int, include_children: bool) -> int | None:
        try:
            proc = self._proc(pid)
            total = proc.memory_info().rss
            if include_children:
                for child in proc.children(recursive=True):
                    try:
                        total += child.memory_info().rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            return total
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def forget(self, pid: int) -> None:
        self._procs.pop(pid, None)


@dataclass
class _State:
    spec: ComponentSpec
    added_at: float
    grace_end: float
    stalled_since: float  # when progress last changed or work was taken
    last_seen_alive: float
    last_under_limit: float
    last_heartbeat_at: float | None = None
    progress: dict[str, int] | None = None
    holds_work: bool = False
    has_crashed: bool = False
    reported: set[str] = field(default_factory=set)


class Watchdog:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 probe: ProcessProbe | None = None):
        self.clock = clock
        self.probe = probe if probe is not None else PsutilProbe()
        self._states: dict[str, _State] = {}

    # -- membership ---------------------------------------------------------
    def add(self, spec: ComponentSpec, now: float | None = None) -> None:
        """Watch `spec` from `now`; replaces (and re-arms) an entry of the same
        name, which is what a restart does."""
        now = self.clock() if now is None else now
        old = self._states.get(spec.name)
        if old is not None:
            self.probe.forget(old.spec.pid)
        self.probe.forget(spec.pid)
        self._states[spec.name] = _State(
            spec=spec, added_at=now, grace_end=now + spec.startup_grace_s,
            stalled_since=now, last_seen_alive=now, last_under_limit=now)

    def remove(self, name: str) -> None:
        state = self._states.pop(name, None)
        if state is not None:
            self.probe.forget(state.spec.pid)

    def __contains__(self, name: str) -> bool:
        return name in self._states

    @property
    def names(self) -> list[str]:
        return list(self._states)

    def pid_of(self, name: str) -> int | None:
        state = self._states.get(name)
        return None if state is None else state.spec.pid

    # -- inbox --------------------------------------------------------------
    def on_message(self, msg: Heartbeat | Ready, now: float | None = None) -> bool:
        if isinstance(msg, Heartbeat):
            return self.on_heartbeat(msg, now)
        return self.on_ready(msg, now)

    def on_heartbeat(self, hb: Heartbeat, now: float | None = None) -> bool:
        """Record `hb`; False if it is not from a watched, live incarnation."""
        state = self._accept(hb.component, hb.pid)
        if state is None:
            return False
        now = self.clock() if now is None else now
        self._seen(state, now)
        work_taken = hb.holds_work and not state.holds_work
        if hb.progress != state.progress or work_taken:
            state.stalled_since = now
            state.reported.discard(HUNG)
        if not hb.holds_work:
            state.reported.discard(HUNG)
        state.progress = dict(hb.progress)
        state.holds_work = hb.holds_work
        return True

    def on_ready(self, msg: Ready, now: float | None = None) -> bool:
        """Ends the startup grace early; counts as a heartbeat for the deadline."""
        state = self._accept(msg.component, msg.pid)
        if state is None:
            return False
        now = self.clock() if now is None else now
        state.grace_end = min(state.grace_end, now)
        self._seen(state, now)
        return True

    def _accept(self, component: str, pid: int) -> _State | None:
        state = self._states.get(component)
        if state is None or state.spec.pid != pid or state.has_crashed:
            return None
        return state

    @staticmethod
    def _seen(state: _State, now: float) -> None:
        state.last_heartbeat_at = now
        state.last_seen_alive = max(state.last_seen_alive, now)
        state.reported.discard(HEARTBEAT_MISSED)

    # -- judgement ------------------------------------------------------------
    def check(self, now: float | None = None) -> list[Fault]:
        """New faults since the previous check, each once per incident. A bug
        or probe error for one component is logged and skips only that one."""
        now = self.clock() if now is None else now
        faults: list[Fault] = []
        for state in list(self._states.values()):
            if state.has_crashed:
                continue
            try:
                faults.extend(self._check_one(state, now))
            except Exception:
                log.exception("watchdog: checking %s failed", state.spec.name)
        return faults

    def _check_one(self, state: _State, now: float) -> list[Fault]:
        spec = state.spec
        if not self.probe.is_alive(spec.pid):
            state.has_crashed = True
            return [self._fault(state, CRASHED, now, state.last_seen_alive)]
        state.last_seen_alive = now
        faults = []
        for kind, since, detail in (self._oom(state, now), self._missed(state, now),
                                    self._hung(state, now)):
            if kind is not None and kind not in state.reported:
                state.reported.add(kind)
                faults.append(self._fault(state, kind, now, since, **detail))
        return faults

    def _oom(self, state: _State, now: float):
        spec = state.spec
        if spec.memory_limit_bytes is None or OOM in state.reported:
            return None, 0.0, {}
        rss = self.probe.rss_bytes(spec.pid, spec.memory_include_children)
        if rss is None or rss <= spec.memory_limit_bytes:
            state.last_under_limit = now
            return None, 0.0, {}
        return OOM, state.last_under_limit, {"rss_bytes": rss,
                                             "limit_bytes": spec.memory_limit_bytes}

    def _missed(self, state: _State, now: float):
        if now <= state.grace_end:
            return None, 0.0, {}
        last = state.last_heartbeat_at if state.last_heartbeat_at is not None else -math.inf
        ref = max(last, state.grace_end)
        if now - ref <= state.spec.heartbeat_deadline_s:
            return None, 0.0, {}
        return HEARTBEAT_MISSED, ref, {"silent_s": round(now - ref, 3),
                                       "ever_heard": state.last_heartbeat_at is not None}

    def _hung(self, state: _State, now: float):
        stalled_s = now - state.stalled_since
        if not state.holds_work or stalled_s <= state.spec.progress_deadline_s:
            return None, 0.0, {}
        return HUNG, state.stalled_since, {"stalled_s": round(stalled_s, 3),
                                           "progress": dict(state.progress or {})}

    @staticmethod
    def _fault(state: _State, kind: str, now: float, since: float, **detail) -> Fault:
        return Fault(component=state.spec.name, kind=kind, detail=detail,
                     pid=state.spec.pid, detected_at=now, since=since)
