"""When to restart a failed component, when to stop trying, and how to stop a
process without ever touching another one.

Restart budget and backoff, per component name (times on the caller's clock):

    failure at t  ->  failures in (t - window_s, t] counted, t included = attempt
                      attempt <= max_restarts  ->  restart after delay_s(attempt) =
                                    min(max_delay_s, base_delay_s * factor**(attempt-1))
                      attempt >  max_restarts  ->  give_up; the component is failed
                                                   (every later failure: give_up) until reset()

So max_restarts is the number of restarts allowed within any window_s: with
the defaults, failures 1..5 inside a minute restart after 0.5, 1, 2, 4, 8 s
and the sixth gives up (a crash loop). The counter decays on its own: a
failure older than window_s no longer counts, neither for the budget nor for
the backoff exponent. on_recovered(name, now) is the same rule seen from the
healthy side: call it whenever the component is seen healthy; it forgets the
failures that left the window and says whether the record is now clean (the
moment to log "recovered"). Being healthy never erases failures still inside
the window, or a component that crashes just after each start would never be
given up.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

RESTART, GIVE_UP = "restart", "give_up"


@dataclass(frozen=True)
class Decision:
    """action: RESTART (after delay_s) or GIVE_UP (delay_s is 0).
    attempt: failures of this component within the window, this one included."""

    action: str
    delay_s: float
    attempt: int


class RestartPolicy:
    def __init__(self, base_delay_s: float = 0.5, max_delay_s: float = 30.0,
                 factor: float = 2.0, max_restarts: int = 5, window_s: float = 60.0):
        for name, value in (("base_delay_s", base_delay_s), ("max_delay_s", max_delay_s),
                            ("window_s", window_s)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.factor = factor
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._failures: dict[str, deque[float]] = {}
        self._failed: set[str] = set()

    def on_failure(self, name: str, now: float) -> Decision:
        failures = self._failures.setdefault(name, deque())
        failures.append(now)
        self._prune(failures, now)
        attempt = len(failures)
        if name in self._failed or attempt > self.max_restarts:
            self._failed.add(name)
            return Decision(GIVE_UP, 0.0, attempt)
        return Decision(RESTART, self.delay_s(attempt), attempt)

    def delay_s(self, attempt: int) -> float:
        """The backoff before restart number `attempt` (1-based)."""
        return min(self.max_delay_s, self.base_delay_s * self.factor ** (attempt - 1))

    def on_recovered(self, name: str, now: float) -> bool:
        """`name` is healthy at `now`: drop failures that left the window; True
        once none remain (backoff back to base_delay_s)."""
        failures = self._failures.get(name)
        if failures is None:
            return True
        self._prune(failures, now)
        if failures:
            return False
        del self._failures[name]
        return True

    def num_failures(self, name: str, now: float) -> int:
        failures = self._failures.get(name)
        if failures is None:
            return 0
        self._prune(failures, now)
        return len(failures)

    def is_failed(self, name: str) -> bool:
        return name in self._failed

    def reset(self, name: str) -> None:
        """Forget everything about `name` (an operator restarted it by hand)."""
        self._failures.pop(name, None)
        self._failed.discard(name)

    def _prune(self, failures: deque[float], now: float) -> None:
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()


# -- stopping one process ------------------------------------------------------
TERMINATED, KILLED, GONE = "terminated", "killed", "gone"


def terminate(target: int | subprocess.Popen, grace_s: float,
              include_children: bool = False, kill_wait_s: float = 5.0) -> str:
    """SIGTERM `target`, wait up to grace_s, then SIGKILL; returns TERMINATED
    (exited within grace), KILLED (needed SIGKILL) or GONE (already exited).

    Only the given pid is signalled, plus, with include_children, the
    descendants psutil lists *before* any signal is sent (they are signalled
    and waited for the same way). Signals go through psutil, which refuses a
    pid reused by another process. Our own children are reaped; pass the
    Popen for a child you started so its returncode survives (reaping by pid
    would leave Popen.returncode at 0).
    """
    popen = target if isinstance(target, subprocess.Popen) else None
    pid = popen.pid if popen is not None else target
    if popen is not None and popen.poll() is not None:
        return GONE
    try:
        proc = psutil.Process(pid)
        if popen is None and proc.status() == psutil.STATUS_ZOMBIE:
            _has_exited(proc, None)  # reap if it is ours
            return GONE
        children = proc.children(recursive=True) if include_children else []
    except psutil.NoSuchProcess:
        return GONE
    is_gone = not _signal(proc, "terminate")
    for child in children:
        _signal(child, "terminate")
    if is_gone:
        _wait_exit(children, grace_s, None)
        return GONE
    alive = _wait_exit([proc, *children], grace_s, popen)
    if not alive:
        return TERMINATED
    for p in alive:
        _signal(p, "kill")
    still = _wait_exit(alive, kill_wait_s, popen)
    if still:
        log.warning("terminate: pids %s survived SIGKILL for %s s",
                    [p.pid for p in still], kill_wait_s)
    return KILLED if proc in alive else TERMINATED


def _signal(proc: psutil.Process, how: str) -> bool:
    """False if the process is already gone."""
    try:
        getattr(proc, how)()
        return True
    except psutil.NoSuchProcess:
        return False


def _has_exited(proc: psutil.Process, popen: subprocess.Popen | None) -> bool:
    if popen is not None and proc.pid == popen.pid:
        return popen.poll() is not None
    try:
        proc.wait(timeout=0)  # reaps it if it is our child
        return True
    except psutil.TimeoutExpired:
        try:  # a zombie is dead: ours if it died since the wait above (reap it),
            if proc.status() != psutil.STATUS_ZOMBIE:  # or someone else's
                return False
        except psutil.NoSuchProcess:
            return True
        try:
            proc.wait(timeout=0)
        except (psutil.TimeoutExpired, psutil.NoSuchProcess):
            pass
        return True
    except psutil.NoSuchProcess:
        return True


def _wait_exit(procs: list[psutil.Process], timeout: float,
               popen: subprocess.Popen | None) -> list[psutil.Process]:
    """Poll until every proc exited or `timeout` s passed; the ones still alive."""
    deadline = time.monotonic() + timeout
    alive, pause = list(procs), 0.002
    while True:
        alive = [p for p in alive if not _has_exited(p, popen)]
        remaining = deadline - time.monotonic()
        if not alive or remaining <= 0:
            return alive
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, 0.05)
