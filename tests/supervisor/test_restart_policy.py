"""Backoff, restart budget, window expiry; terminate() on tiny real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from deepserve.supervisor.restart_policy import Decision, RestartPolicy, terminate

IGNORE_TERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "print('ready', flush=True); time.sleep(60)")
SLEEPER = "import sys, time; print('ready', flush=True); time.sleep(60)"
PARENT = ("import subprocess, sys, time; "
          "c = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.DEVNULL); "
          "print(c.pid, flush=True); time.sleep(60)")


def test_delays_double_and_are_capped() -> None:
    policy = RestartPolicy(base_delay_s=0.5, max_delay_s=5.0, factor=2, max_restarts=10,
                           window_s=1000)
    delays = [policy.on_failure("te0", float(t)).delay_s for t in range(8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]


def test_give_up_after_max_restarts_in_window() -> None:
    policy = RestartPolicy(max_restarts=5, window_s=60)
    decisions = [policy.on_failure("te0", 100.0 + t) for t in range(6)]
    assert decisions[:5] == [Decision("restart", d, n)
                             for n, d in zip(range(1, 6), (0.5, 1.0, 2.0, 4.0, 8.0))]
    assert decisions[5] == Decision("give_up", 0.0, 6)
    assert policy.is_failed("te0")
    # failed stays failed, even after the window, until reset
    assert policy.on_failure("te0", 1000.0).action == "give_up"
    assert not policy.is_failed("je")
    assert policy.on_failure("je", 100.0) == Decision("restart", 0.5, 1)  # per component
    policy.reset("te0")
    assert policy.on_failure("te0", 1001.0) == Decision("restart", 0.5, 1)


def test_window_expiry_decays_the_counter() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60)
    for t in (0.0, 10.0, 20.0):
        assert policy.on_failure("w", t).action == "restart"
    assert policy.num_failures("w", 30.0) == 3
    assert policy.num_failures("w", 60.0) == 2  # the failure at 0 left (0, 60]
    # at 71 the window is (11, 71]: only 20 and 71 count -> attempt 2
    assert policy.on_failure("w", 71.0) == Decision("restart", 1.0, 2)
    assert policy.on_failure("w", 72.0) == Decision("restart", 2.0, 3)
    assert policy.on_failure("w", 73.0).action == "give_up"


def test_on_recovered_resets_only_once_failures_left_the_window() -> None:
    policy = RestartPolicy(window_s=60)
    assert policy.on_recovered("w", 0.0)  # never failed
    policy.on_failure("w", 0.0)
    policy.on_failure("w", 5.0)
    assert not policy.on_recovered("w", 10.0)  # healthy, but failures still count
    assert policy.on_failure("w", 20.0).attempt == 3
    assert not policy.on_recovered("w", 79.0)
    assert policy.on_recovered("w", 80.0)
    assert policy.on_failure("w", 81.0) == Decision("restart", 0.5, 1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="factor"):
        RestartPolicy(factor=0.5)
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


def _start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            text=True)
    proc.stdout.readline()  # started (and the handler is installed)
    return proc


def test_normal_child_is_terminated_and_returncode_kept() -> None:
    proc = _start(SLEEPER)
    try:
        assert terminate(proc, grace_s=5.0) == "terminated"
        assert proc.returncode == -15
        assert terminate(proc, grace_s=5.0) == "gone"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_child_ignoring_sigterm_is_killed_after_grace() -> None:
    proc = _start(IGNORE_TERM)
    try:
        start = time.monotonic()
        assert terminate(proc.pid, grace_s=0.3) == "killed"  # by pid: psutil reaps it
        assert 0.3 <= time.monotonic() - start < 3.0
        assert not psutil.pid_exists(proc.pid) or \
            psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_gone_pid_and_unreaped_zombie() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    assert terminate(proc.pid, grace_s=0.1) == "gone"
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        p = psutil.Process(zombie.pid)
        deadline = time.monotonic() + 10
        while p.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert terminate(zombie.pid, grace_s=0.1) == "gone"  # and reaped
        assert not psutil.pid_exists(zombie.pid)
    finally:
        zombie.wait(timeout=10)


def test_include_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, IGNORE_TERM],
                              stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        child = psutil.Process(child_pid)
        time.sleep(0.2)  # let the grandchild install its SIGTERM handler
        assert terminate(parent, grace_s=0.3, include_children=True) == "terminated"
        assert parent.returncode == -15
        deadline = time.monotonic() + 5
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "grandchild survived"
            time.sleep(0.01)
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()


def test_without_include_children_only_the_pid_is_signalled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, SLEEPER],
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert terminate(parent, grace_s=5.0) == "terminated"
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()
        if child is not None:
            assert terminate(child.pid, grace_s=5.0) in ("terminated", "gone")
