"""ProcessTable on tiny `python -c` children: start, respawn with the next
incarnation's command, stop with children, sweep, stop_all."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from deepserve.ipc.segments import list_segments
from deepserve.supervisor.process_table import ProcessTable
from deepserve.supervisor.restart_policy import GONE, KILLED, TERMINATED

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
IGNORE_TERM = [sys.executable, "-c",
               "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "print('ready', flush=True); time.sleep(60)"]
WITH_CHILD = [sys.executable, "-c",
              "import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "time.sleep(60)"]


@pytest.fixture
def table():
    started: list[tuple[str, int]] = []
    t = ProcessTable(on_start=lambda name, p: started.append((name, p.pid)))
    t.started = started
    yield t
    names = list(t.procs)
    t.stop_all([names], 1.0)
    assert all(p.poll() is not None for p in t.procs.values())


def test_start_respawn_and_the_incarnation_command(table, tmp_path):
    seen = tmp_path / "seen"

    def command(n: int) -> list[str]:
        return [sys.executable, "-c", f"open({str(seen)!r}, 'a').write('{n} '); exit({n})"]
    first = table.start("a", command)
    assert first.wait(10) == 0 and table.poll("a") == 0 and table.incarnation("a") == 0
    second = table.respawn("a")
    assert second.wait(10) == 1 and table.incarnation("a") == 1
    assert seen.read_text() == "0 1 "
    assert table.started == [("a", first.pid), ("a", second.pid)]
    assert table.list() == {"a": (second.pid, 1)} and table.pid("a") == second.pid
    with pytest.raises(ValueError):
        table.start("a", command)



def test_a_process_being_started_is_not_listed_until_it_runs(table, monkeypatch):
    """procs never holds a name without its process: another thread reading it
    while Popen forks saw None (CI: a node's teardown met a pod mid-spawn)."""
    import deepserve.supervisor.process_table as module
    seen = []

    def popen(*args, **kwargs):
        seen.append(dict(table.procs))  # what a reader sees during the fork
        return real(*args, **kwargs)
    real = module.subprocess.Popen
    monkeypatch.setattr(module.subprocess, "Popen", popen)
    table.start("s", SLEEP)
    assert seen == [{}] and table.procs["s"].poll() is None

def test_respawn_refuses_a_running_process(table):
    table.start("s", SLEEP)
    with pytest.raises(RuntimeError):
        table.respawn("s")
    assert table.stop("s", 1.0) == TERMINATED
    assert table.poll("s") == -signal.SIGTERM
    assert table.stop("s", 1.0) == GONE


def test_stop_kills_what_ignores_sigterm(table):
    popen = table.start("stubborn", IGNORE_TERM, env={**os.environ})
    time.sleep(0.3)  # its handler installed
    t0 = time.monotonic()
    assert table.stop("stubborn", 0.3) == KILLED
    assert popen.returncode == -signal.SIGKILL and time.monotonic() - t0 >= 0.3


def test_stop_takes_the_children_too(table):
    popen = table.start("host", WITH_CHILD)
    deadline = time.monotonic() + 10
    while not psutil.Process(popen.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = psutil.Process(popen.pid).children()[0]
    assert table.stop("host", 1.0) == TERMINATED
    child.wait(5)  # raises if it outlived its host
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_sweep_unlinks_only_its_own_scratch(table):
    scratch = f"t{uuid.uuid4().hex[:6]}te0-"
    mine = [f"deepserve-{scratch}{n}-kv" for n in range(2)]
    other = f"deepserve-{scratch[:-1]}x-0-kv"  # another TE's prefix: te0x
    for name in [*mine, other]:
        Path("/dev/shm", name).write_bytes(b"x")
    run_dir = Path(tempfile.mkdtemp(prefix=f"ds-{scratch}1-"))
    try:
        table.start("te0", SLEEP, scratch=scratch)
        table.start("je", SLEEP)
        assert table.sweep("je") == []
        assert table.sweep("te0") == sorted(mine)
        assert list_segments(f"deepserve-{scratch}") == [] and not run_dir.exists()
        assert Path("/dev/shm", other).exists()
    finally:
        Path("/dev/shm", other).unlink(missing_ok=True)


def test_stop_all_by_waves_and_remove(table):
    for name in ("gw", "te0", "cm"):
        table.start(name, SLEEP)
    table.start("stubborn", IGNORE_TERM)
    time.sleep(0.3)
    t0 = time.monotonic()
    table.stop_all([["gw", "te0", "stubborn"], ["cm"]], 0.5)
    assert time.monotonic() - t0 < 5
    assert {n: p.returncode for n, p in table.procs.items()} == {
        "gw": -signal.SIGTERM, "te0": -signal.SIGTERM, "stubborn": -signal.SIGKILL,
        "cm": -signal.SIGTERM}
    for name in list(table.procs):
        table.remove(name)
    assert table.procs == {} and "gw" not in table


def test_adopt_makes_a_pods_process_the_next_incarnation(table, tmp_path):
    """A pre-warmed process becomes a TE: new name, its pid kept, the pod gone;
    a later respawn runs the TE's own command with the incarnation after."""
    pod = table.start("pool0", SLEEP)
    seen = tmp_path / "seen"

    def command(n: int) -> list[str]:
        return [sys.executable, "-c", f"open({str(seen)!r}, 'a').write('{n} ')"]
    assert table.next_incarnation("te") == 0
    adopted = table.adopt("pool0", "te", command, scratch="x-")
    assert adopted is pod and "pool0" not in table and table.pid("te") == pod.pid
    assert table.incarnation("te") == 0 and table.next_incarnation("te") == 1
    other = table.start("pool1", SLEEP)
    with pytest.raises(RuntimeError, match="still running"):
        table.adopt("pool1", "te", command)  # te's process still runs: the pod stays
    assert "pool1" in table and table.pid("pool1") == other.pid
    table.stop("te", 1.0)
    assert table.adopt("pool1", "te", command) is other and table.incarnation("te") == 1
    table.stop("te", 1.0)
    assert table.respawn("te").wait(10) == 0 and table.incarnation("te") == 2
    assert seen.read_text() == "2 "
