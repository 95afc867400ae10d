"""The processes a supervisor may act on: named children started from commands.

    ProcessTable ── start(name, cmd, env) ──> Popen (incarnation 0)
                 ── respawn(name) ─────────> Popen (incarnation n+1, same command)
                 ── adopt(pod, name, ...) ─> name's next incarnation is pod's process
                                             (a pre-warmed process given a TE)
                 ── stop(name, grace_s) ───> SIGTERM, SIGKILL after grace (and its children)
                 ── sweep(name) ───────────> unlink what a killed incarnation left behind
                 ── procs / poll / pid ────> what runs now

The supervisor drives a node only through this table (and the health log),
so it can be tested against any child, a `python -c` script included.

A command is a list, or a callable taking the incarnation number (0 for the
first start, +1 per respawn) and returning the list: a TE names its shared
memory with a fresh run id per incarnation, so a restart never meets what a
predecessor left. `scratch` is that run id's common prefix: a process started
with one names its shared memory deepserve-<scratch>* and its run directories
ds-<scratch>*, and sweep() removes them (only the creator unlinks shared
memory, and a SIGKILLed creator cannot).

Thread rule: the supervisor's thread calls everything except stop() and
sweep(), which its stop threads call for a name nobody respawns meanwhile.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from deepserve.ipc.segments import list_segments, unlink_segment
from deepserve.supervisor.restart_policy import terminate

log = logging.getLogger(__name__)

Command = list[str] | Callable[[int], list[str]]


@dataclass
class _Entry:
    cmd: Command
    env: dict | None
    scratch: str | None
    incarnation: int = 0
    popen: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return list(self.cmd(self.incarnation) if callable(self.cmd) else self.cmd)


class ProcessTable:
    """on_start(name, popen) is called after every (re)start (the node logs
    `started`)."""

    def __init__(self, on_start: Callable[[str, subprocess.Popen], None] | None = None):
        self._entries: dict[str, _Entry] = {}
        self._on_start = on_start

    # -- starting ----------------------------------------------------------------
    def start(self, name: str, cmd: Command, env: dict | None = None, *,
              scratch: str | None = None) -> subprocess.Popen:
        if name in self._entries:
            raise ValueError(f"{name!r} is already in the process table")
        entry = _Entry(cmd, env, scratch)
        self._launch(name, entry)
        self._entries[name] = entry  # whole before it is visible: other threads read procs
        return entry.popen

    def respawn(self, name: str) -> subprocess.Popen:
        """Start `name` again with the command it was first started with (the
        next incarnation); the previous one must be gone."""
        entry = self._entries[name]
        if entry.popen is not None and entry.popen.poll() is None:
            raise RuntimeError(f"{name} (pid {entry.popen.pid}) is still running")
        entry.incarnation += 1
        return self._launch(name, entry)

    def next_incarnation(self, name: str) -> int:
        """The incarnation name's next (re)start will have (0 if never started)."""
        entry = self._entries.get(name)
        return 0 if entry is None else entry.incarnation + 1

    def adopt(self, pod: str, name: str, cmd: Command, env: dict | None = None, *,
              scratch: str | None = None) -> subprocess.Popen:
        """Make pod's running process the next incarnation of `name` (created
        with cmd / env / scratch for later respawns if new; its previous
        incarnation must be gone); pod leaves the table."""
        entry = self._entries.get(name)
        if entry is not None and entry.popen is not None and entry.popen.poll() is None:
            raise RuntimeError(f"{name} (pid {entry.popen.pid}) is still running")
        popen = self._entries.pop(pod).popen
        if entry is None:  # whole before it is visible: other threads read procs
            self._entries[name] = _Entry(cmd, env, scratch, popen=popen)
        else:
            entry.incarnation += 1
            entry.popen = popen
        return popen

    def _launch(self, name: str, entry: _Entry) -> subprocess.Popen:
        entry.popen = subprocess.Popen(entry.command(), env=entry.env)
        if self._on_start is not None:
            self._on_start(name, entry.popen)
        return entry.popen

    # -- reading -----------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._entries

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """name -> its current incarnation's Popen (a copy: safe to iterate)."""
        return {name: e.popen for name, e in list(self._entries.items())}

    def list(self) -> dict[str, tuple[int, int | None]]:
        """name -> (pid, returncode or None while it runs)."""
        return {name: (e.popen.pid, e.popen.poll()) for name, e in self._entries.items()}

    def pid(self, name: str) -> int:
        return self._entries[name].popen.pid

    def poll(self, name: str) -> int | None:
        """The exit code of `name`'s current incarnation, None while it runs."""
        return self._entries[name].popen.poll()

    def incarnation(self, name: str) -> int:
        """0 before and after the first start, +1 per respawn."""
        entry = self._entries.get(name)
        return 0 if entry is None else entry.incarnation

    # -- stopping ----------------------------------------------------------------
    def stop(self, name: str, grace_s: float) -> str:
        """SIGTERM `name` and its descendants, SIGKILL what is left after
        grace_s; restart_policy's TERMINATED, KILLED or GONE. The entry stays
        (respawn() may follow)."""
        return terminate(self._entries[name].popen, grace_s, include_children=True)

    def stop_all(self, waves: Iterable[Iterable[str]], grace_s: float) -> None:
        """Wave by wave: SIGTERM every process of the wave at once, wait up to
        grace_s for all of them, then SIGKILL (with children) and sweep the rest."""
        for wave in waves:
            wave = [n for n in wave if n in self._entries]
            for name in wave:
                popen = self._entries[name].popen
                if popen.poll() is None:
                    popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for name in wave:
                try:
                    self._entries[name].popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s: killing", name, grace_s)
                    self.stop(name, 0.1)
                    self.sweep(name)

    def remove(self, name: str) -> None:
        """Forget `name` (stop() it first; sweep() it before, if it needs it)."""
        del self._entries[name]

    def sweep(self, name: str) -> list[str]:
        """Unlink the shared memory, and remove the run directories, of every
        incarnation of `name`; the segment names unlinked."""
        entry = self._entries.get(name)
        if entry is None or entry.scratch is None:
            return []
        return sweep_scratch(entry.scratch)


def sweep_scratch(scratch: str) -> list[str]:
    names = list_segments(f"deepserve-{scratch}")
    for segment in names:
        unlink_segment(segment)
    for run_dir in Path(tempfile.gettempdir()).glob(f"ds-{scratch}*"):
        shutil.rmtree(run_dir, ignore_errors=True)  # its launcher's ipc sockets
    return names
