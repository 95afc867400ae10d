"""ActorLife and the fault hooks: the floor-0 skeleton every process runs on,
over a real ZeroMQ ipc socket standing in for the supervisor's inbox."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepserve.actor import ActorLife, run_main
from deepserve.faults import ENV_VAR as DRILL_ENV
from deepserve.faults import FaultHooks, NoFaults
from deepserve.ipc.heartbeat import ENV_VAR as HEARTBEAT_ENV
from deepserve.ipc.heartbeat import NullHeartbeat
from deepserve.ipc.sockets import PullSocket, ipc_address
from deepserve.messages.health import HealthEvent, Heartbeat, Ready


@pytest.fixture
def inbox(supervisor_inbox):
    return supervisor_inbox.inbox


def _receive(inbox: PullSocket, n: int, timeout: float = 3.0) -> list:
    msgs, deadline = [], time.monotonic() + timeout
    while len(msgs) < n and time.monotonic() < deadline:
        try:
            msgs.append(inbox.get(timeout=0.1))
        except TimeoutError:
            pass
    return msgs


def _connected() -> None:
    """The heartbeat PUSH drops what it cannot queue at once (IMMEDIATE):
    give its connect a moment before the first message."""
    time.sleep(0.2)


@pytest.fixture(autouse=True)
def _restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_without_a_supervisor_every_call_is_a_no_op(monkeypatch):
    monkeypatch.delenv(HEARTBEAT_ENV, raising=False)
    monkeypatch.delenv(DRILL_ENV, raising=False)
    life = ActorLife("t")
    assert isinstance(life.heartbeat, NullHeartbeat) and isinstance(life.faults, NoFaults)
    life.ready()
    life.beat({"steps": 1}, True)
    life.event("request_migrated", request_id="r")
    assert life.faults.active("stall") is None and life.faults.consume("kv-fail") is None
    life.close()


def test_ready_beats_and_events_reach_the_supervisor(inbox):
    life = ActorLife("je", component="job-executor")
    _connected()
    try:
        life.ready(model="m")
        life.beat({"tasks": 2}, holds_work=True)
        life.event("request_migrated", request_id="r1")
        ready, beat, event = _receive(inbox, 3)
    finally:
        life.close()
    assert isinstance(ready, Ready) and ready.component == "job-executor"
    assert ready.details == {"model": "m"} and ready.pid == os.getpid()
    assert isinstance(beat, Heartbeat) and beat.progress == {"tasks": 2} and beat.holds_work
    assert isinstance(event, HealthEvent) and event.event == "request_migrated"
    assert event.details == {"request_id": "r1"}


def test_run_beats_from_the_loop_and_stops_when_the_step_says_so(inbox):
    life = ActorLife("w", component="te0/worker0", heartbeat_interval_s=0.01)
    _connected()
    counter = {"steps": 0}

    def step():
        counter["steps"] += 1
        time.sleep(0.02)
        return counter["steps"] < 5

    try:
        life.run(step, lambda: dict(counter), lambda: counter["steps"] % 2 == 1)
        beats = [m for m in _receive(inbox, 5) if isinstance(m, Heartbeat)]
    finally:
        life.close()
    assert counter["steps"] == 5
    assert [b.progress["steps"] for b in beats] == [0, 1, 2, 3, 4]
    assert [b.holds_work for b in beats] == [False, True, False, True, False]


def test_run_ends_on_a_stop_request_and_on_sigterm():
    life = ActorLife("t")
    calls = []
    life.run(lambda: (calls.append(1), life.request_stop()), dict)
    assert calls == [1]
    life2 = ActorLife("t2")
    os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
    assert life2.should_stop()


def test_a_reparented_child_stops():
    assert not ActorLife("t", parent_pid=os.getppid()).should_stop()
    assert ActorLife("t", parent_pid=os.getppid() + 1_000_000).should_stop()


def test_a_death_pipe_at_eof_stops_the_actor():
    import multiprocessing

    reader, writer = multiprocessing.Pipe(duplex=False)
    life = ActorLife("t", death_pipe=reader)
    assert not life.should_stop()
    writer.close()  # the parent died
    assert life.should_stop()


def test_a_firing_fault_is_reported_once_per_activation(supervisor_inbox):
    inbox, drill = supervisor_inbox.inbox, supervisor_inbox.drills
    life = ActorLife("w", component="te0/worker0")
    _connected()
    try:
        assert life.faults.active("stall") is None
        (drill / "te0.worker0.stall").write_text("")  # empty file: active, value ""
        time.sleep(0.06)
        assert life.faults.active("stall") == ""
        time.sleep(0.06)
        assert life.faults.active("stall") == ""  # still on: not reported again
        (drill / "te0.worker0.kv-fail").write_text("")
        assert life.faults.consume("kv-fail") == ""  # one-shot: the file is gone
        assert not (drill / "te0.worker0.kv-fail").exists()
        assert life.faults.consume("kv-fail") is None
        events = [m for m in _receive(inbox, 2) if isinstance(m, HealthEvent)]
    finally:
        life.close()
    assert [(e.event, e.details["fault"]) for e in events] == [
        ("fault_injected", "stall"), ("fault_injected", "kv-fail")]
    assert life.faults.num_fired == 2


def test_a_fault_switched_off_and_on_again_fires_again(short_dir):
    fired = []
    hooks = FaultHooks(short_dir, "te0/master", interval_s=0.0,
                       on_fired=lambda f, v: fired.append((f, v)))
    path = hooks.path("slow")
    assert path.name == "te0.master.slow"
    path.write_text("0.5\n")
    assert hooks.active("slow") == "0.5"
    path.unlink()
    assert hooks.active("slow") is None
    path.write_text("1")
    assert hooks.active("slow") == "1"
    assert fired == [("slow", "0.5"), ("slow", "1")]


def test_an_event_sent_right_after_start_and_before_exit_is_not_lost(inbox):
    """A TE that fires its crash fault at start reports it, then exits at once:
    the event waits for the connection and the close lingers until it left."""
    life = ActorLife("te", component="te0")
    life.event("fault_injected", fault="crash", value="")  # no _connected(): at once
    life.close()
    msgs = _receive(inbox, 1)
    assert [(m.event, m.details["fault"]) for m in msgs] == [("fault_injected", "crash")]


class _Counter:
    """An actor for run_main: a PULL socket in the given context, a step that
    counts and ends the loop at `steps` (or raises there), a recorded close."""

    def __init__(self, ctx, address, log, steps=3, fail=False):
        self.socket = PullSocket(ctx, address, bind=True, type=Heartbeat)
        self.log, self.steps, self.fail, self.num_steps = log, steps, fail, 0

    def step(self):
        self.num_steps += 1
        if self.fail and self.num_steps == self.steps:
            raise RuntimeError("step failed")
        return self.num_steps < self.steps

    def close(self):
        self.log.append("closed")
        self.socket.close()


def _main(argv, build, settings="the settings"):
    """run_main as a role's main() would call it; returns the context build saw."""
    seen = {}

    def building(ctx, s, life):
        seen.update(ctx=ctx, settings=s, life=life)
        return build(ctx)
    run_main("job-executor", "test actor", argv, lambda args: settings, building,
             lambda actor: {"steps": actor.num_steps})
    return seen


def test_run_main_prints_the_settings_and_builds_nothing(capsys):
    built = []
    _main(["--conf", "x.json", "--role", "job-executor", "--print-config"], built.append,
          settings={"max_attempts": 7})
    assert built == [] and capsys.readouterr().out == '{"max_attempts":7}\n'


def test_run_main_runs_the_actor_then_closes_it_before_the_context(supervisor_inbox, short_dir):
    log = []
    seen = _main(["--conf", "x.json", "--role", "job-executor"],
                 lambda ctx: _Counter(ctx, ipc_address(short_dir, "a"), log))
    msgs = _receive(supervisor_inbox.inbox, 4)
    assert isinstance(msgs[0], Ready) and msgs[0].component == "job-executor"
    assert [m.progress["steps"] for m in msgs[1:] if isinstance(m, Heartbeat)][:1] == [0]
    assert log == ["closed"] and seen["ctx"].closed and seen["settings"] == "the settings"
    assert isinstance(seen["life"].heartbeat, NullHeartbeat)  # life closed last


def test_run_main_closes_everything_when_a_step_raises(short_dir):
    log = []
    with pytest.raises(RuntimeError, match="step failed"):
        _main(["--conf", "x.json", "--role", "job-executor"],
              lambda ctx: _Counter(ctx, ipc_address(short_dir, "a"), log, fail=True))
    assert log == ["closed"]


def test_a_failed_build_leaves_no_socket_to_block_the_context(short_dir):
    made = {}

    def build(ctx):
        made["ctx"] = ctx
        PullSocket(ctx, ipc_address(short_dir, "a"), bind=True, type=Heartbeat)  # made; then:
        raise ValueError("bad settings")
    with pytest.raises(ValueError, match="bad settings"):
        _main(["--conf", "x.json", "--role", "job-executor"], build)
    assert made["ctx"].closed
