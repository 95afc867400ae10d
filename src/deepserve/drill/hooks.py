"""Fault hooks for drills: off unless the supervisor enables drills.

With drills enabled (conf [supervisor] drill = true) the node sets
DEEPSERVE_DRILL_DIR for every process; a drill injects a fault by creating
`<dir>/<component, "/" as ".">.<fault>`, e.g. `te0.worker0.stall`. A process
looks for its own files at most every `interval_s` per fault (a stat call),
and not at all when drills are off: `FaultHooks.from_env` returns None.

    fault       who         effect
    stall       worker      stop making progress, keep sending heartbeats
    slow        worker      sleep <file content> seconds after each step
    drop-cache  master      wipe the RTC prefix cache once (file removed)
    kv-fail     worker      fail the next KV transfer mid-way (file removed)
    crash       TE host     exit at start (crash-loop drills)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV_VAR = "DEEPSERVE_DRILL_DIR"


class FaultHooks:
    def __init__(self, directory: str | os.PathLike, component: str, interval_s: float = 0.05):
        self.directory = Path(directory)
        self.prefix = component.replace("/", ".")
        self.interval_s = interval_s
        self._checked: dict[str, tuple[float, str | None]] = {}

    @classmethod
    def from_env(cls, component: str) -> "FaultHooks | None":
        directory = os.environ.get(ENV_VAR)
        return cls(directory, component) if directory else None

    def path(self, fault: str) -> Path:
        return self.directory / f"{self.prefix}.{fault}"

    def active(self, fault: str) -> str | None:
        """The fault file's content ("" if empty) while it exists, else None."""
        now = time.monotonic()
        checked = self._checked.get(fault)
        if checked is not None and now - checked[0] < self.interval_s:
            return checked[1]
        try:
            value = self.path(fault).read_text().strip()
        except FileNotFoundError:
            value = None
        self._checked[fault] = (now, value)
        return value

    def consume(self, fault: str) -> str | None:
        """Like active(), but a one-shot fault: its file is removed."""
        value = self.active(fault)
        if value is not None:
            self.path(fault).unlink(missing_ok=True)
            self._checked.pop(fault, None)
        return value
