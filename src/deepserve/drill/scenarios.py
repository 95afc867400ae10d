"""Drill scenarios: which component of which TE gets which fault, what counts
as the supervisor noticing it, and what counts as recovered.

    scenario          target            fault (how)                         deadline_s
    kill-worker       te0/worker0       SIGKILL (pid from the health log)   heartbeat_deadline_s
    kill-master       te0/master        SIGKILL                             heartbeat_deadline_s
    kill-tokenizer    te0/tokenizer     SIGKILL                             heartbeat_deadline_s
    hang-worker       te0/worker0       SIGSTOP (heartbeats stop too)       heartbeat_deadline_s
    stall-worker      te0/worker0       hook file te0.worker0.stall         progress_deadline_s
    slow-worker       te0/worker0       hook file te0.worker0.slow ("0.05") progress_deadline_s
    drop-cache        te0/master        hook file te0.master.drop-cache     -
    kv-transfer-fail  <prefill>/worker0 hook file <prefill>.worker0.kv-fail -

deadline_s is the supervisor deadline that bounds detection: a dead or
SIGSTOPped process sends no heartbeat, so it is found within the heartbeat
deadline at the latest (a crash is usually seen sooner, by the pid probe); an
in-loop stall keeps heartbeating and is found by the progress deadline. For
slow-worker it is the deadline the slowed worker must stay clear of (the
supervisor should *not* act: detect_s is normally None). drop-cache and
kv-transfer-fail are not the supervisor's business (no deadline).

Detection (restarting scenarios): the first "crashed", "killed", "hung" or
"heartbeat_missed" event of the target TE (component "teN" or "teN/...")
after the fault. Recovery: the TE's "recovered" event after the fault (the
replacement served its warm-up request and is back in the TE list). The other
scenarios report as detection only such an event if one happens, and recover
at the first completed request that started after the fault
(load.first_success_after).

Fault files (only honoured when the node runs with [supervisor] drill = true):
`<drill_dir>/<component with "/" -> ".">.<fault>`. The drill removes every
file it made at cleanup (stall: as soon as the stall is detected, so the
replacement worker does not stall again), and SIGKILLs a process it SIGSTOPped
if, at the end, that very pid still exists and is still stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from deepserve.supervisor.health_log import read_events

log = logging.getLogger(__name__)

HEALTH_LOG = "health.jsonl"
DETECT_EVENTS = frozenset({"crashed", "killed", "hung", "heartbeat_missed"})
PID_EVENTS = frozenset({"started", "ready"})
RECOVERED = "recovered"
TIME_SLACK_S = 0.002  # health log times are truncated to milliseconds

HEARTBEAT, PROGRESS = "heartbeat", "progress"


# --- the health log --------------------------------------------------------------------------

def event_time(event: dict) -> float:
    """An event's ISO time ("2025-01-01T12:00:00.123Z") as Unix epoch seconds."""
    return datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00")).timestamp()


def te_of(component: str) -> str:
    """"te0/worker0" -> "te0"; "te0" -> "te0"; "gateway" -> "gateway"."""
    return component.split("/", 1)[0]


class HealthEvents:
    """The node's health log (`<log_dir>/health.jsonl` and its rotated files),
    re-read on every call: small, and robust to rotation."""

    def __init__(self, log_dir: str | os.PathLike):
        self.log_dir = Path(log_dir)

    @property
    def path(self) -> Path:
        return self.log_dir / HEALTH_LOG

    def events(self, since: float | None = None) -> list[dict]:
        """Every event (oldest first; `t` added: epoch seconds), those at or
        after `since` (minus the log's millisecond truncation) if given."""
        files = sorted(self.log_dir.glob(HEALTH_LOG + ".*"),
                       key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
        files = [p for p in files if p.suffix[1:].isdigit()] + [self.path]
        out: list[dict] = []
        for path in files:
            try:
                for event in read_events(path, on_bad_line=lambda n, line: None):
                    try:
                        event["t"] = event_time(event)
                    except (KeyError, TypeError, ValueError):
                        continue
                    if since is None or event["t"] >= since - TIME_SLACK_S:
                        out.append(event)
            except FileNotFoundError:
                continue
        out.sort(key=lambda e: e["t"])  # stable: same-millisecond events keep file order
        return out

    def latest_pid(self, component: str) -> tuple[int, float] | None:
        """(pid, event time) of the component's latest "started"/"ready" event with a pid."""
        for event in reversed(self.events()):
            if (event.get("component") == component and event.get("event") in PID_EVENTS
                    and isinstance(event.get("pid"), int)):
                return event["pid"], event["t"]
        return None

    def first(self, since: float, events: frozenset[str] | set[str],
              te: str | None = None) -> dict | None:
        """The first event named in `events` at or after `since`, of TE `te`'s
        components when given ("te0", "te0/worker0", ...)."""
        for event in self.events(since):
            if event.get("event") in events and (
                    te is None or te_of(str(event.get("component", ""))) == te):
                return event
        return None

    def te_types(self) -> dict[str, str]:
        """te id -> te_type as far as the log's details say (key te_type or type)."""
        types: dict[str, str] = {}
        for event in self.events():
            details = event.get("details") or {}
            kind = details.get("te_type") or details.get("type")
            component = str(event.get("component", ""))
            if isinstance(kind, str) and component.startswith("te"):
                types[te_of(component)] = kind
        return types


# --- scenarios -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    name: str
    part: str
    """The component inside the TE: worker0, master, tokenizer."""
    fault: str
    """SIGKILL / SIGSTOP (signals to the part's pid) or a hook: stall, slow, drop-cache, kv-fail."""
    deadline: str | None
    """Which supervisor deadline applies: HEARTBEAT, PROGRESS or None."""
    restarts: bool
    """The supervisor is expected to replace the TE: detection + "recovered" event."""
    te_type: str | None = None
    """Target the first TE of this type (kv-transfer-fail: prefill) instead of te0."""
    hook_content: str = ""
    hold_s: float = 0.0
    """Hook faults the drill lifts itself (slow): seconds before the file is removed."""
    description: str = ""

    @property
    def is_signal(self) -> bool:
        return self.fault in ("SIGKILL", "SIGSTOP")


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("kill-worker", "worker0", "SIGKILL", HEARTBEAT, True,
             description="SIGKILL the TE's worker process"),
    Scenario("kill-master", "master", "SIGKILL", HEARTBEAT, True,
             description="SIGKILL the TE's master process"),
    Scenario("kill-tokenizer", "tokenizer", "SIGKILL", HEARTBEAT, True,
             description="SIGKILL the TE's tokenizer process"),
    Scenario("hang-worker", "worker0", "SIGSTOP", HEARTBEAT, True,
             description="SIGSTOP the TE's worker (no progress, no heartbeats)"),
    Scenario("stall-worker", "worker0", "stall", PROGRESS, True,
             description="the worker stops making progress but keeps heartbeating"),
    Scenario("slow-worker", "worker0", "slow", PROGRESS, False, hook_content="0.05", hold_s=3.0,
             description="every worker step 50 ms slower for 3 s (must not count as hung)"),
    Scenario("drop-cache", "master", "drop-cache", None, False,
             description="the master wipes its prefix cache once"),
    Scenario("kv-transfer-fail", "worker0", "kv-fail", None, False, te_type="prefill",
             description="the prefill TE's next KV transfer fails mid-way"),
)}

ALIASES = {"hang-worker-sigstop": "hang-worker", "hang-worker-stall": "stall-worker"}


def get_scenario(name: str, mode: str | None = None) -> Scenario:
    """By name; hang-worker takes a mode: "sigstop" (default) or "stall"."""
    name = ALIASES.get(name, name)
    if mode is not None:
        if name not in ("hang-worker", "stall-worker"):
            raise ValueError(f"--mode applies to hang-worker only, not {name}")
        if mode not in ("sigstop", "stall"):
            raise ValueError(f"unknown hang mode {mode!r}: sigstop or stall")
        name = "hang-worker" if mode == "sigstop" else "stall-worker"
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def deadline_of(scenario: Scenario, supervisor) -> float | None:
    """The configured deadline (seconds) that applies to `scenario`;
    `supervisor` is NodeConfig.supervisor (or None: the defaults 3 / 5 s)."""
    if scenario.deadline == HEARTBEAT:
        return float(getattr(supervisor, "heartbeat_deadline_s", 3.0))
    if scenario.deadline == PROGRESS:
        return float(getattr(supervisor, "progress_deadline_s", 5.0))
    return None


def target_te(scenario: Scenario, te_types: dict[str, str], default: str = "te0") -> str:
    """The TE the scenario hits: `default`, or the first TE (by number) whose
    type is scenario.te_type. te_types: te id -> type (node config / health log)."""
    if scenario.te_type is None:
        return default
    matches = sorted((te for te, kind in te_types.items() if kind == scenario.te_type),
                     key=lambda te: int(te[2:]) if te[2:].isdigit() else 1 << 30)
    if not matches:
        raise LookupError(f"{scenario.name}: no {scenario.te_type} TE "
                          f"(known: {te_types or 'none'})")
    return matches[0]


def hook_path(drill_dir: str | os.PathLike, component: str, fault: str) -> Path:
    return Path(drill_dir) / f"{component.replace('/', '.')}.{fault}"


# --- one injected fault ----------------------------------------------------------------------

@dataclass
class Injection:
    """A fault being applied, and everything needed to take it back."""

    scenario: Scenario
    te: str
    component: str
    at: float | None = None
    """Epoch seconds just before the fault was applied."""
    pid: int | None = None
    hook: Path | None = None
    lifted_at: float | None = None
    """When the drill took the fault back (slow: file removed; stall: removed on detection)."""
    notes: list[str] = field(default_factory=list)

    # -- applying -------------------------------------------------------------------------

    def inject(self, events: HealthEvents | None, drill_dir: str | os.PathLike | None,
               now=time.time) -> float:
        """Apply the fault; returns (and records) its time."""
        s = self.scenario
        if s.is_signal:
            if events is None:
                raise RuntimeError(f"{s.name}: needs the health log (--log-dir) to find pids")
            self.pid = current_pid(events, self.component)
            sig = signal.SIGKILL if s.fault == "SIGKILL" else signal.SIGSTOP
            self.at = now()
            os.kill(self.pid, sig)
        else:
            if drill_dir is None:
                raise RuntimeError(f"{s.name}: needs the node's drill dir (--drill-dir)")
            self.hook = hook_path(drill_dir, self.component, s.fault)
            tmp = self.hook.with_name(self.hook.name + ".tmp")
            tmp.write_text(s.hook_content)
            self.at = now()
            os.replace(tmp, self.hook)  # the engine never sees a half-written file
        return self.at

    def hook_consumed(self) -> bool:
        """One-shot hooks (drop-cache, kv-fail): the engine deleted the file."""
        return self.hook is not None and not self.hook.exists()

    def lift(self, now=time.time) -> None:
        """Take a hook fault back (remove its file) if it is still there."""
        if self.hook is not None and self.hook.exists():
            try:
                self.hook.unlink()
                self.lifted_at = now()
            except FileNotFoundError:
                pass

    def cleanup(self) -> None:
        """At the end, whatever happened: no fault file left behind, no process of
        ours left stopped (the SIGSTOPped pid, only if it is still stopped)."""
        self.lift()
        if self.scenario.fault == "SIGSTOP" and self.pid is not None:
            try:
                proc = psutil.Process(self.pid)
                if proc.status() == psutil.STATUS_STOPPED:
                    self.notes.append(f"pid {self.pid} still stopped at the end: SIGKILL")
                    os.kill(self.pid, signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError, psutil.AccessDenied):
                pass


def current_pid(events: HealthEvents, component: str) -> int:
    """The live pid of `component` per its latest started/ready event; refuses a
    pid that is gone or belongs to a process created after that event (reuse)."""
    found = events.latest_pid(component)
    if found is None:
        raise LookupError(f"no started/ready event with a pid for {component} in {events.path}")
    pid, t = found
    try:
        proc = psutil.Process(pid)
        if proc.create_time() > t + 1.0:
            raise LookupError(f"pid {pid} of {component} was reused (created after {t})")
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise LookupError(f"pid {pid} of {component} is a zombie")
    except psutil.NoSuchProcess:
        raise LookupError(f"pid {pid} of {component} is gone") from None
    return pid


def wait_pid(events: HealthEvents, component: str, timeout_s: float) -> int:
    """current_pid, waiting up to timeout_s for the component to (re)appear."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return current_pid(events, component)
        except LookupError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.2)
