"""Applying one drill fault, and taking it back whatever happened.

    signal faults   health log: latest started/ready pid of the component
                    ──checked (alive, not reused, not a zombie)──> os.kill(pid, SIGKILL|SIGSTOP)
    hook faults     <drill_dir>/<component, "/" as ".">.<fault>   written via tmp + rename,
                    one file per target component
    corrupt         every *.kv under the disk tier's directory: its last payload
                    byte flipped in place (the size stays: only the checksum tells)

The engine side of the hooks is deepserve/faults.py: it reads these files
only when the node runs with drills on, and reports each firing as a
`fault_injected` health event (which proof.py waits for).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from deepserve.drill.health_events import HealthEvents
from deepserve.drill.scenarios import Scenario

REUSE_SLACK_S = 5.0
"""A pid whose process started this long after its started event was reused."""


def hook_path(drill_dir: str | os.PathLike, component: str, fault: str) -> Path:
    return Path(drill_dir) / f"{component.replace('/', '.')}.{fault}"


@dataclass
class Injection:
    """A fault being applied, and everything needed to take it back.
    components: the targets, e.g. ["te0/worker0"]; a signal goes to the first
    only, a hook file is written for each."""

    scenario: Scenario
    te: str
    components: list[str]
    at: float | None = None
    """Epoch seconds just before the fault was applied."""
    pid: int | None = None
    """The pid the signal was delivered to."""
    te_pid: int | None = None
    """The TE host's pid when the signal was sent (it exits once it loses a process)."""
    hooks: list[Path] = field(default_factory=list)
    lifted_at: float | None = None
    """When the drill took the fault back (slow: file removed; stall: removed on detection)."""
    notes: list[str] = field(default_factory=list)
    killer: Callable[[], tuple[list[int], float]] | None = None
    """kill-node: kills the whole node; (its pids, the time just before)."""
    pids: list[int] = field(default_factory=list)
    """kill-node: every pid the kill went to."""
    disk_dir: str | None = None
    """corrupt: the node's [node] disk_cache_dir."""
    corrupted: list[Path] = field(default_factory=list)
    """corrupt: the block files it damaged."""

    @property
    def component(self) -> str:
        return self.components[0]

    def inject(self, events: HealthEvents | None, drill_dir: str | os.PathLike | None,
               now=time.time) -> float:
        """Apply the fault; returns (and records) its time."""
        if self.scenario.kills_node:
            if self.killer is None:
                raise RuntimeError(f"{self.scenario.name}: runs on a cluster the drill starts")
            self.pids, self.at = self.killer()
        elif self.scenario.is_signal:
            self._send_signal(events, now)
        elif self.scenario.fault == "corrupt":
            self._corrupt_blocks(now)
        else:
            self._write_hooks(drill_dir, now)
        return self.at

    def _send_signal(self, events: HealthEvents | None, now) -> None:
        s = self.scenario
        if events is None:
            raise RuntimeError(f"{s.name}: needs the health log (--log-dir) to find pids")
        self.pid = current_pid(events, self.component)
        host = events.latest_pid(self.te)
        self.te_pid = host[0] if host is not None else None
        sig = signal.SIGKILL if s.fault == "SIGKILL" else signal.SIGSTOP
        self.at = now()
        os.kill(self.pid, sig)  # raises if the pid vanished since current_pid: no silent miss

    def fill_disk(self, send_fresh_prompt: Callable[[], object], timeout_s: float = 10.0) -> None:
        """Before corrupt: one fresh prompt, so the disk tier holds a block file
        to corrupt (repeated prompts are host hits: an earlier corrupt-disk's
        files, dropped, were never written again); waits for one."""
        send_fresh_prompt()
        deadline = time.monotonic() + timeout_s
        while self.disk_dir and not any(Path(self.disk_dir).rglob("*.kv")) \
                and time.monotonic() < deadline:
            time.sleep(0.2)

    def _corrupt_blocks(self, now) -> None:
        if not self.disk_dir:
            raise RuntimeError(f"{self.scenario.name}: the node has no disk tier "
                               "([node] disk_cache_dir)")
        self.at = now()
        for path in sorted(Path(self.disk_dir).rglob("*.kv")):
            try:
                with open(path, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last[0] ^ 0x55]))
            except (OSError, IndexError):
                continue  # evicted (deleted) or emptied meanwhile: not corrupted
            self.corrupted.append(path)
        self.notes.append(f"{len(self.corrupted)} block files corrupted")

    def _write_hooks(self, drill_dir: str | os.PathLike | None, now) -> None:
        s = self.scenario
        if drill_dir is None:
            raise RuntimeError(f"{s.name}: needs the node's drill dir (--drill-dir)")
        staged = []
        for component in self.components:
            hook = hook_path(drill_dir, component, s.fault)
            tmp = hook.with_name(hook.name + ".tmp")
            tmp.write_text(s.hook_content)
            staged.append((tmp, hook))
        self.at = now()
        for tmp, hook in staged:
            os.replace(tmp, hook)  # the engine never sees a half-written file
            self.hooks.append(hook)

    def hook_consumed(self) -> bool:
        """One-shot hooks (drop-cache, kv-fail): the engine deleted every file."""
        return bool(self.hooks) and not any(hook.exists() for hook in self.hooks)

    def lift(self, now=time.time) -> None:
        """Take a hook fault back (remove its files) if they are still there."""
        for hook in self.hooks:
            try:
                hook.unlink()
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


def is_gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs no more)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def current_pid(events: HealthEvents, component: str) -> int:
    """The live pid of `component` per its latest started/ready event; refuses a
    pid that is gone or belongs to a process created after that event (reuse)."""
    found = events.latest_pid(component)
    if found is None:
        raise LookupError(f"no started/ready event with a pid for {component} in {events.path}")
    pid, t = found
    try:
        proc = psutil.Process(pid)
        # create_time() comes from boot time + start ticks (whole-second boot
        # time, a container's clock): only a process born well after the event
        # is a reuse
        if proc.create_time() > t + REUSE_SLACK_S:
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
