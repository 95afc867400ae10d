"""Fault hooks for drills: off unless the supervisor enables drills.

With drills enabled (conf [supervisor] drill = true) the node sets
DEEPSERVE_DRILL_DIR for every process; a drill injects a fault by creating
`<dir>/<component, "/" as ".">.<fault>`, e.g. `te0.worker0.stall`. A process
looks for its own files at most every `interval_s` per fault (a stat call),
and not at all when drills are off: `FaultHooks.from_env` returns `NoFaults`.

    fault       who         effect
    stall       worker      stop making progress, keep sending heartbeats
    slow        worker      sleep <file content> seconds after each step
    drop-cache  master      wipe the RTC prefix cache once (file removed)
    kv-fail     worker      fail the next KV transfer mid-way (file removed)
    crash       TE host     exit at start (crash-loop drills)
    poison      worker      exit 13 (as a segfault) on any step whose new tokens
                            of a sequence contain the file's comma-separated
                            token ids (a request of death; drill `poison`)
    bad-sampling worker     a new sequence seeded <file content> gets a sampling
                            state that raises: a per-request error, not a crash
    disk-full   kv-cache    every disk tier write fails with ENOSPC (the tier turns off)
    stage-die   worker      exit 13 after the first block of its next stage op (a
                            decode TE reading storage for a prefill TE: DualPath)

A fault that takes effect calls `on_fired(fault, value)` once per activation
(ActorLife turns that into a `fault_injected` health event), so a drill can
prove its fault happened before it judges the recovery. An empty fault file
is an active fault whose value is "": test `is not None`, never truthiness.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

ENV_VAR = "DEEPSERVE_DRILL_DIR"


class FaultHooks:
    def __init__(self, directory: str | os.PathLike, component: str, interval_s: float = 0.05,
                 on_fired: Callable[[str, str], None] | None = None):
        self.directory = Path(directory)
        self.prefix = component.replace("/", ".")
        self.interval_s = interval_s
        self.on_fired = on_fired
        self.num_fired = 0
        self._checked: dict[str, tuple[float, str | None]] = {}
        self._announced: set[str] = set()  # faults active now whose firing was reported

    @classmethod
    def from_env(cls, component: str,
                 on_fired: Callable[[str, str], None] | None = None) -> "FaultHooks | NoFaults":
        directory = os.environ.get(ENV_VAR)
        if not directory:
            return NoFaults()
        return cls(directory, component, on_fired=on_fired)

    def path(self, fault: str) -> Path:
        return self.directory / f"{self.prefix}.{fault}"

    def active(self, fault: str) -> str | None:
        """The fault file's content ("" if empty) while it exists, else None.
        The first call that sees a (new) activation reports it as fired."""
        now = time.monotonic()
        checked = self._checked.get(fault)
        if checked is not None and now - checked[0] < self.interval_s:
            return checked[1]
        try:
            value = self.path(fault).read_text().strip()
        except FileNotFoundError:
            value = None
        self._checked[fault] = (now, value)
        if value is None:
            self._announced.discard(fault)
        elif fault not in self._announced:
            self._announced.add(fault)
            self._fired(fault, value)
        return value

    def consume(self, fault: str) -> str | None:
        """Like active(), but a one-shot fault: its file is removed."""
        value = self.active(fault)
        if value is not None:
            self.path(fault).unlink(missing_ok=True)
            self._checked.pop(fault, None)
            self._announced.discard(fault)
        return value

    def _fired(self, fault: str, value: str) -> None:
        self.num_fired += 1
        if self.on_fired is not None:
            self.on_fired(fault, value)


class NoFaults:
    """Drills off: no fault is ever active, and checking costs nothing."""

    num_fired = 0

    def active(self, fault: str) -> None:
        return None

    def consume(self, fault: str) -> None:
        return None
