"""Watchdog rules on a fake clock and fake processes; crashed on real ones."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from deepserve.messages.health import Heartbeat, Ready
from deepserve.supervisor.watchdog import ComponentSpec, Fault, PsutilProbe, Watchdog

PID = 4242


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeProbe:
    def __init__(self) -> None:
        self.dead: set[int] = set()
        self.rss: dict[int, int] = {}
        self.rss_calls: list[tuple[int, bool]] = []

    def is_alive(self, pid: int) -> bool:
        return pid not in self.dead

    def rss_bytes(self, pid: int, include_children: bool) -> int | None:
        self.rss_calls.append((pid, include_children))
        return self.rss.get(pid)

    def forget(self, pid: int) -> None:
        pass


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def probe() -> FakeProbe:
    return FakeProbe()


@pytest.fixture
def dog(clock, probe) -> Watchdog:
    return Watchdog(clock=clock, probe=probe)


def spec(**kw) -> ComponentSpec:
    base = dict(name="te0/worker0", pid=PID, heartbeat_deadline_s=2.0,
                progress_deadline_s=10.0, startup_grace_s=5.0)
    base.update(kw)
    return ComponentSpec(**base)


def beat(dog: Watchdog, steps: int, holds_work: bool, pid: int = PID,
         name: str = "te0/worker0") -> bool:
    return dog.on_heartbeat(Heartbeat(component=name, pid=pid, time=0.0,
                                      progress={"steps": steps}, holds_work=holds_work))


def run(dog: Watchdog, clock: FakeClock, until: float, step: float = 0.5,
        on_tick=None) -> list[Fault]:
    """Advance the clock to `until` (relative to now) checking every `step`."""
    faults, end = [], clock.now + until
    while clock.now < end:
        clock.now = min(end, clock.now + step)
        if on_tick is not None:
            on_tick()
        faults += dog.check()
    return faults


def kinds(faults: list[Fault]) -> list[str]:
    return [f.kind for f in faults]


def test_no_fault_while_progressing(dog, clock) -> None:
    dog.add(spec())
    steps = iter(range(10_000))
    faults = run(dog, clock, 60.0, on_tick=lambda: beat(dog, next(steps), True))
    assert faults == []


def test_hung_after_deadline_only_while_holding_work(dog, clock) -> None:
    dog.add(spec(heartbeat_deadline_s=100.0))
    beat(dog, 7, True)
    start = clock.now
    # heartbeats keep coming (it answers) but the counter is stuck at 7
    faults = run(dog, clock, 9.5, on_tick=lambda: beat(dog, 7, True))
    assert faults == []
    clock.now = start + 10.0
    assert dog.check() == []  # exactly at the deadline: not yet
    clock.now = start + 10.5
    beat(dog, 7, True)
    (fault,) = dog.check()
    assert (fault.component, fault.kind, fault.pid) == ("te0/worker0", "hung", PID)
    assert fault.since == start and fault.detected_at == start + 10.5
    assert fault.latency_s == 10.5
    assert fault.detail == {"stalled_s": 10.5, "progress": {"steps": 7}}
    # once per incident
    assert run(dog, clock, 30.0, on_tick=lambda: beat(dog, 7, True)) == []


def test_not_hung_when_idle(dog, clock) -> None:
    dog.add(spec())
    assert run(dog, clock, 120.0, on_tick=lambda: beat(dog, 3, False)) == []


def test_taking_work_starts_the_stall_clock(dog, clock) -> None:
    dog.add(spec())
    assert run(dog, clock, 60.0, on_tick=lambda: beat(dog, 3, False)) == []
    took = clock.now
    beat(dog, 3, True)  # idle for a minute, now holds work: not hung at once
    faults = run(dog, clock, 12.0, on_tick=lambda: beat(dog, 3, True))
    assert kinds(faults) == ["hung"]
    assert faults[0].since == took


def test_any_counter_change_resets_the_clock(dog, clock) -> None:
    dog.add(spec())
    n = iter(range(1000))
    faults = run(dog, clock, 60.0, step=9.0,
                 on_tick=lambda: dog.on_heartbeat(Heartbeat(
                     component="te0/worker0", pid=PID, time=0.0,
                     progress={"steps": 5, "tokens": next(n)}, holds_work=True)))
    assert faults == []


def test_hung_rearms_after_progress_resumes(dog, clock) -> None:
    dog.add(spec(heartbeat_deadline_s=100.0))
    beat(dog, 1, True)
    assert kinds(run(dog, clock, 11.0)) == ["hung"]
    beat(dog, 2, True)  # progress: incident over
    assert dog.check() == []
    assert kinds(run(dog, clock, 11.0)) == ["hung"]


def test_heartbeat_missed_after_grace(dog, clock) -> None:
    added = clock.now
    dog.add(spec())
    # no heartbeat at all: grace 5 s, then deadline 2 s after its end
    faults = run(dog, clock, 7.0, step=0.5)
    assert faults == []
    faults = run(dog, clock, 1.0, step=0.5)
    assert kinds(faults) == ["heartbeat_missed"]
    assert faults[0].since == added + 5.0
    assert faults[0].detail["ever_heard"] is False
    assert run(dog, clock, 30.0) == []  # once


def test_heartbeat_missed_rearms_when_beats_resume(dog, clock) -> None:
    dog.add(spec())
    dog.on_ready(Ready(component="te0/worker0", pid=PID, time=0.0))  # grace over
    beat(dog, 1, False)
    last = clock.now
    faults = run(dog, clock, 3.0)
    assert kinds(faults) == ["heartbeat_missed"] and faults[0].since == last
    assert faults[0].detected_at == last + 2.5
    beat(dog, 1, False)
    assert dog.check() == []
    assert kinds(run(dog, clock, 3.0)) == ["heartbeat_missed"]


def test_ready_ends_grace_early(dog, clock) -> None:
    dog.add(spec(startup_grace_s=60.0))
    clock.now += 1.0
    assert dog.on_message(Ready(component="te0/worker0", pid=PID, time=0.0))
    assert kinds(run(dog, clock, 3.0)) == ["heartbeat_missed"]


def test_stopped_process_holding_work_is_missed_then_hung(dog, clock) -> None:
    dog.add(spec())
    dog.on_ready(Ready(component="te0/worker0", pid=PID, time=0.0))
    beat(dog, 9, True)
    stopped = clock.now
    faults = run(dog, clock, 20.0)  # SIGSTOP: silence from here on
    assert kinds(faults) == ["heartbeat_missed", "hung"]
    assert faults[0].detected_at == stopped + 2.5
    assert faults[1].detected_at == stopped + 10.5 and faults[1].since == stopped


def test_oom_with_fake_rss(dog, clock, probe) -> None:
    dog.add(spec(memory_limit_bytes=1000, memory_include_children=True))
    probe.rss[PID] = 900
    assert run(dog, clock, 1.0, on_tick=lambda: beat(dog, 0, False)) == []
    under = clock.now
    probe.rss[PID] = 1001
    faults = run(dog, clock, 5.0, on_tick=lambda: beat(dog, 0, False))
    assert kinds(faults) == ["oom"]
    assert faults[0].detail == {"rss_bytes": 1001, "limit_bytes": 1000}
    assert faults[0].since == under
    assert probe.rss_calls[0] == (PID, True)
    assert not dog.check()


def test_crashed_is_terminal_and_reported_once(dog, clock, probe) -> None:
    dog.add(spec())
    beat(dog, 1, True)
    probe.dead.add(PID)
    faults = run(dog, clock, 60.0)
    assert kinds(faults) == ["crashed"]  # no missed/hung for a dead process
    assert not beat(dog, 2, True)  # nothing more accepted from it


def test_readd_rearms_and_old_pid_is_ignored(dog, clock, probe) -> None:
    dog.add(spec())
    probe.dead.add(PID)
    assert kinds(dog.check()) == ["crashed"]
    dog.add(spec(pid=PID + 1))
    assert not beat(dog, 5, True, pid=PID)  # late beat of the old incarnation
    assert beat(dog, 5, True, pid=PID + 1)
    assert kinds(run(dog, clock, 11.0, on_tick=lambda: beat(dog, 5, True, pid=PID + 1))) \
        == ["hung"]
    dog.remove("te0/worker0")
    assert "te0/worker0" not in dog and dog.check() == []
    assert not beat(dog, 5, True, pid=PID + 1)


def test_unknown_component_is_ignored(dog) -> None:
    assert not beat(dog, 1, True, name="nobody")


def test_a_probe_error_skips_only_that_component(dog, clock, probe) -> None:
    def boom(pid: int) -> bool:
        if pid == PID:
            raise RuntimeError("probe bug")
        return pid not in probe.dead

    probe.is_alive = boom
    dog.add(spec())
    dog.add(spec(name="other", pid=PID + 7))
    probe.dead.add(PID + 7)
    assert [(f.component, f.kind) for f in dog.check()] == [("other", "crashed")]


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _until_zombie(pid: int) -> None:
    proc = psutil.Process(pid)
    deadline = time.monotonic() + 10
    while proc.status() != psutil.STATUS_ZOMBIE:  # exited, not reaped (no wait)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_real_reaped_and_zombie_children_are_crashed() -> None:
    reaped = _child("pass")
    zombie = _child("pass")
    alive = _child("import time; time.sleep(30)")
    try:
        reaped.wait(timeout=10)
        _until_zombie(zombie.pid)
        probe = PsutilProbe()
        dog = Watchdog(probe=probe)
        for name, p in (("reaped", reaped), ("zombie", zombie), ("alive", alive)):
            dog.add(ComponentSpec(name=name, pid=p.pid, memory_limit_bytes=1 << 40))
        faults = dog.check()
        assert sorted((f.component, f.kind) for f in faults) \
            == [("reaped", "crashed"), ("zombie", "crashed")]
        assert dog.check() == []
        assert probe.rss_bytes(alive.pid, include_children=False) > 0
        alive.kill()
        alive.wait(timeout=10)
        assert [(f.component, f.kind) for f in dog.check()] == [("alive", "crashed")]
    finally:
        for p in (reaped, zombie, alive):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
