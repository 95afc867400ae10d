"""Scratch that nodes started as commands leave, scoped to this test's nodes.

A node names its run directory `ds-n<run id>-...` (under $TMPDIR) and every
shared-memory segment after the same run id (`deepserve-<run id><te>-...`,
the weight cache's `deepserve-w<run id>`). A test that only compared
/dev/shm before and after would count a second test run's segments on the
same machine (and sweeping the difference would delete them). So the nodes
get a private TMPDIR, a thread notes the run ids that appear in it, and
leftovers are only what carries those run ids.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

SHM = Path("/dev/shm")
_RUN_DIR = re.compile(r"ds-n([0-9a-f]+)-")


class Scratch:
    """The private TMPDIR is short (/tmp/dst-XXXX): the nodes' ZeroMQ ipc://
    paths live under it, and a Unix socket path has at most 107 bytes."""

    def __init__(self, poll_s: float = 0.2):
        self.tmp = Path(tempfile.mkdtemp(prefix="dst-"))
        self.runs: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """The environment for a node command: the private TMPDIR."""
        return {**os.environ, "TMPDIR": str(self.tmp)}

    def _note(self) -> None:
        for path in self.tmp.iterdir():
            match = _RUN_DIR.match(path.name)
            if match:
                self.runs.add(match.group(1))

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            self._note()

    def leftovers(self) -> set[Path]:
        """This test's nodes' run directories and segments still present."""
        self._note()
        shm = {p for p in SHM.glob("deepserve-*") if any(run in p.name for run in self.runs)}
        return shm | {p for p in self.tmp.iterdir() if p.name.startswith("ds-")}

    def sweep(self) -> None:
        """Remove the leftovers (what a killed host could not clean up)."""
        for path in self.leftovers():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop watching (leftovers() still answers); remove_dir() at the end."""
        self._stop.set()
        self._thread.join(5)

    def remove_dir(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
