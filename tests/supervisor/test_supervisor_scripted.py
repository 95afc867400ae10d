"""The supervisor against tiny scripted processes, no model, in seconds.

    test ── ProcessTable.start ──> child.py <component> <mode> ...   (real processes)
    child ── ActorLife heartbeats (DEEPSERVE_HEARTBEAT) ──> Supervisor inbox
    test (fake CM) <──TEDown── Supervisor ──SUB── TEList ── test (fake CM PUB)

Each child plays one part: beat (healthy), crash (exit 3), hang (SIGSTOP
itself: silent), stall (beats holding work, counters frozen, ignores
SIGTERM), host:<mode> (a TE host whose worker is a child process). A command
picks the mode from the incarnation, so "fail once, then behave" is exact.
Every test asserts the exact health-log sequence and the detection bounds,
and the fixture checks that no process outlives it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import psutil
import pytest
import zmq

from deepserve.faults import ENV_VAR as DRILL_ENV
from deepserve.ipc.heartbeat import ENV_VAR as HEARTBEAT_ENV
from deepserve.ipc.sockets import PubSocket, PullSocket
from deepserve.messages.control import TEDown, TEInfo, TEList
from deepserve.supervisor.health_log import HealthLog, read_events
from deepserve.supervisor.node_config import SupervisorConfig
from deepserve.supervisor.process_table import ProcessTable
from deepserve.supervisor.supervisor import Supervisor

pytestmark = pytest.mark.slow  # starts process trees

HEARTBEAT_S, PROGRESS_S = 0.8, 0.6  # deadlines; children beat every 0.1 s
SLACK_S = 1.0  # detection may lag a deadline by ticks, scheduling and the log write
CONFIG = SupervisorConfig(heartbeat_deadline_s=HEARTBEAT_S, progress_deadline_s=PROGRESS_S,
                          startup_grace_s=5.0, restart_base_delay_s=0.2,
                          restart_max_delay_s=1.0, max_restarts=2, restart_window_s=60,
                          kill_grace_s=0.3)

CHILD = r'''
import os, signal, subprocess, sys, time
from deepserve.actor import ActorLife

component, mode, stamp, parent = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


def mark():  # when the fault began, for the detection bound
    with open(stamp, "w") as f:
        f.write(repr(time.time()))


if mode == "crash":
    sys.exit(3)
if mode.startswith("host:"):  # a TE host; its worker is a process of its own
    subprocess.Popen([sys.executable, __file__, component + "/worker0", mode[5:], stamp,
                      str(os.getpid())])
    time.sleep(60)  # SIGTERM (default action) ends it
    sys.exit(0)
life = ActorLife(component, parent_pid=parent, heartbeat_interval_s=0.1)
try:
    while life.heartbeat.num_sent == 0:  # until connected, sends are dropped (IMMEDIATE)
        life.beat({"steps": 0})
        time.sleep(0.01)
    life.ready()
    if mode == "events":
        life.event("no_such_event", note="dropped, never written")
        life.event("fault_injected", fault="stall", value="")
    if mode == "deposed":  # a head's CM that heard a higher term
        life.event("head_stepped_down", term=1, new_term=2, heard_from="n2")
    if mode in ("beat", "events", "deposed"):
        n = 0
        while not life.should_stop():
            n += 1
            life.beat({"steps": n})
            time.sleep(0.02)
    elif mode == "hang":
        for n in range(1, 4):
            life.beat({"steps": n})
            time.sleep(0.1)
        mark()
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "stall":
        mark()
        while True:  # stuck holding work; SIGTERM only sets a flag nobody reads
            life.beat({"steps": 7}, holds_work=True)
            time.sleep(0.02)
finally:
    life.close()
'''


class Harness:
    """A supervisor over a ProcessTable of scripted children, plus a fake CM."""

    def __init__(self, run_dir: Path, watched: tuple[str, ...]):
        self.run_dir = run_dir
        self.script = run_dir / "child.py"
        self.script.write_text(CHILD)
        address = {n: f"ipc://{run_dir}/{n}.sock" for n in ("hb", "cm", "cm-pub")}
        self.health = HealthLog(run_dir / "health.jsonl", node="test")
        self.table = ProcessTable(on_start=lambda name, p: self.health.write(name, "started",
                                                                             p.pid))
        self.tes: set[str] = set()
        self.ctx = zmq.Context()
        self.cm_pub = PubSocket(self.ctx, address["cm-pub"])
        self.cm_inbox = PullSocket(self.ctx, address["cm"], bind=True, type=TEDown)
        self.sup = Supervisor(self.table, self.health, CONFIG, tes=self.tes,
                              inbox=address["hb"], cm_pub=address["cm-pub"], cm=address["cm"],
                              watched=watched, tick_s=0.05)
        self.env = {**os.environ, HEARTBEAT_ENV: address["hb"]}
        self.env.pop(DRILL_ENV, None)

    def spawn(self, name: str, mode: str | Callable[[int], str], *, component: str | None = None,
              is_te: bool = False) -> None:
        """Start `name`; mode(incarnation) picks each incarnation's part."""
        pick = mode if callable(mode) else (lambda n: mode)
        component = component or name
        if is_te:
            self.tes.add(name)

        def command(n: int) -> list[str]:
            return [sys.executable, str(self.script), component, pick(n),
                    str(self.stamp(name, n)), str(os.getpid())]
        self.table.start(name, command, self.env)

    def stamp(self, name: str, incarnation: int = 0) -> Path:
        return self.run_dir / f"{name}-{incarnation}.stamp"

    def fault_time(self, name: str, incarnation: int = 0) -> float:
        return float(self.stamp(name, incarnation).read_text())

    def events(self, prefix: str = "") -> list[dict]:
        return [e for e in read_events(self.run_dir / "health.jsonl")
                if e["component"].split("/")[0] == prefix or not prefix]

    def seq(self, prefix: str) -> list[tuple[str, str]]:
        return [(e["component"], e["event"]) for e in self.events(prefix)]

    def wait_for(self, prefix: str, component: str, event: str, count: int = 1,
                 timeout: float = 10.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events(prefix)
                     if e["component"] == component and e["event"] == event]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no {count}x {component} {event}: {self.seq(prefix)}")

    def te_downs(self) -> list[str]:
        return [msg.te_id for msg in self.cm_inbox.drain()]

    def close(self) -> None:
        self.sup.stop()
        procs = self.table.procs
        self.table.stop_all([list(procs)], 1.0)
        pids = {e["pid"] for e in self.events() if e["event"] == "started"}
        self.cm_pub.close()
        self.cm_inbox.close()
        self.ctx.term()
        self.health.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_is_alive(p) for p in pids):
            time.sleep(0.05)  # a worker notices its dead host within a beat
        leftovers = [p for p in pids if _is_alive(p)]
        for pid in leftovers:
            psutil.Process(pid).kill()
        assert all(p.poll() is not None for p in procs.values())
        assert not leftovers, f"processes outlived the test: {leftovers}"


def _is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _epoch(event: dict) -> float:
    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


@pytest.fixture
def make_harness():
    made: list[tuple[Harness, Path]] = []

    def make(*watched: str) -> Harness:
        run_dir = Path(tempfile.mkdtemp(prefix="ds-sup-"))  # short: ipc paths are limited
        made.append((Harness(run_dir, watched), run_dir))
        return made[-1][0]
    yield make
    for harness, run_dir in made:
        try:
            harness.close()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


def test_beating_processes_are_left_alone(make_harness):
    h = make_harness("sleeper")
    h.spawn("sleeper", "beat")
    h.spawn("te0", "beat", component="te0/worker0", is_te=True)
    h.sup.start()
    h.wait_for("te0", "te0/worker0", "started")
    time.sleep(3 * HEARTBEAT_S)
    assert h.seq("sleeper") == [("sleeper", "started")]
    assert h.seq("te0") == [("te0", "started"), ("te0/worker0", "started")]
    assert h.table.poll("sleeper") is None and h.table.poll("te0") is None
    assert h.te_downs() == [] and h.sup.incidents == {}


def test_a_crash_loop_restarts_with_backoff_then_gives_up(make_harness):
    h = make_harness()
    h.spawn("te1", "crash", is_te=True)
    h.sup.start()
    failed = h.wait_for("te1", "te1", "failed")[0]
    assert h.seq("te1") == [("te1", e) for e in (
        "started", "crashed", "restarting", "started", "crashed", "restarting",
        "started", "crashed", "failed")]
    events = h.events("te1")
    crashed = [e for e in events if e["event"] == "crashed"]
    assert [e["details"]["exit_code"] for e in crashed] == [3, 3, 3]
    restarting = [e["details"] for e in events if e["event"] == "restarting"]
    assert restarting == [{"delay_s": 0.2, "attempt": 1}, {"delay_s": 0.4, "attempt": 2}]
    started = [e for e in events if e["event"] == "started"]
    for crash, restart, delay in zip(crashed, started[1:], (0.2, 0.4)):
        assert _epoch(restart) - _epoch(crash) >= delay - 0.005  # backoff held (ms stamps)
    assert failed["details"]["attempts"] == 3 and "crash loop" in failed["details"]["reason"]
    time.sleep(0.5)
    assert h.te_downs() == ["te1"] * 3  # the JE may resume elsewhere at every failure
    assert len(h.events("te1")) == 9 and h.table.poll("te1") == 3  # left down
    assert h.sup.failed == {"te1"}


def test_a_crashed_te_is_recovered_once_it_is_listed_again(make_harness):
    h = make_harness()
    h.spawn("te2", lambda n: "crash" if n == 0 else "beat", component="te2/master", is_te=True)
    h.sup.start()
    h.wait_for("te2", "te2", "started", count=2)
    # the new incarnation is watched from its first beat (its pid is the new host's)
    master = h.wait_for("te2", "te2/master", "started")[0]
    time.sleep(0.3)
    assert h.seq("te2")[-1] == ("te2/master", "started")  # not recovered: not listed yet
    h.cm_pub.put(TEList(tes=[TEInfo(te_id="te2", model="m", address="ipc://x")]))
    recovered = h.wait_for("te2", "te2", "recovered")[0]
    assert h.seq("te2") == [("te2", "started"), ("te2", "crashed"), ("te2", "restarting"),
                            ("te2", "started"), ("te2/master", "started"), ("te2", "recovered")]
    assert master["pid"] == h.table.pid("te2")
    assert recovered["pid"] == h.table.pid("te2") and recovered["details"]["recover_s"] >= 0.2
    assert h.sup.incidents == {} and h.te_downs() == ["te2"]


def test_a_silent_hang_is_missed_killed_and_restarted(make_harness):
    h = make_harness("je")
    h.spawn("je", lambda n: "hang" if n == 0 else "beat")
    h.sup.start()
    h.wait_for("je", "je", "started", count=2)
    time.sleep(2 * HEARTBEAT_S)  # the new incarnation beats: nothing more happens
    assert h.seq("je") == [("je", e) for e in
                           ("started", "heartbeat_missed", "restarting", "killed", "started")]
    events = h.events("je")
    missed, killed = events[1], events[3]
    detect_s = _epoch(missed) - h.fault_time("je")
    # its last beat left up to one interval (0.1 s) before the stamp
    assert HEARTBEAT_S - 0.15 <= detect_s <= HEARTBEAT_S + SLACK_S, detect_s
    assert missed["details"]["latency_s"] >= HEARTBEAT_S and missed["details"]["ever_heard"]
    assert killed["details"]["how"] == "killed"  # SIGTERM cannot stop a stopped process
    assert killed["pid"] == events[0]["pid"] != events[4]["pid"] == h.table.pid("je")
    assert not _is_alive(events[0]["pid"]) and h.table.poll("je") is None
    assert h.te_downs() == []  # not a TE


def test_a_stalled_te_is_hung_and_replaced(make_harness):
    h = make_harness()
    h.spawn("te3", lambda n: "stall" if n == 0 else "beat", component="te3/master", is_te=True)
    h.sup.start()
    h.wait_for("te3", "te3", "started", count=2)
    time.sleep(2 * PROGRESS_S)
    assert h.seq("te3") == [
        ("te3", "started"), ("te3/master", "started"), ("te3/master", "hung"),
        ("te3", "restarting"), ("te3", "killed"), ("te3", "started"),
        ("te3/master", "started")]  # the new incarnation, watched before it is listed
    hung = h.events("te3")[2]
    detect_s = _epoch(hung) - h.fault_time("te3")
    assert PROGRESS_S <= detect_s <= PROGRESS_S + SLACK_S, detect_s
    assert hung["details"]["progress"] == {"steps": 7} and hung["details"]["stalled_s"] > PROGRESS_S
    assert h.events("te3")[4]["details"]["how"] == "killed"
    assert h.te_downs() == ["te3"]


def test_a_hung_gateway_is_restarted_and_the_rest_keeps_running(make_harness):
    h = make_harness("gateway", "job-executor")
    h.spawn("gateway", lambda n: "stall" if n == 0 else "beat")
    h.spawn("job-executor", "beat")
    h.sup.start()
    je_pid = h.table.pid("job-executor")
    h.wait_for("gateway", "gateway", "started", count=2)
    time.sleep(2 * HEARTBEAT_S)
    assert h.seq("gateway") == [("gateway", e) for e in
                                ("started", "hung", "restarting", "killed", "started")]
    detect_s = _epoch(h.events("gateway")[1]) - h.fault_time("gateway")
    assert PROGRESS_S <= detect_s <= PROGRESS_S + SLACK_S, detect_s
    assert h.seq("job-executor") == [("job-executor", "started")]
    assert h.table.pid("job-executor") == je_pid and h.table.poll("job-executor") is None
    assert h.table.poll("gateway") is None and h.sup.incidents == {}
    assert h.te_downs() == []


def test_a_te_worker_that_hangs_is_killed_before_its_host(make_harness):
    h = make_harness()
    h.spawn("te4", lambda n: "host:hang" if n == 0 else "host:beat", is_te=True)
    h.sup.start()
    h.wait_for("te4", "te4", "started", count=2)
    h.cm_pub.put(TEList(tes=[TEInfo(te_id="te4", model="m", address="ipc://x")]))
    h.wait_for("te4", "te4", "recovered")
    h.wait_for("te4", "te4/worker0", "started", count=2)
    assert h.seq("te4") == [
        ("te4", "started"), ("te4/worker0", "started"), ("te4/worker0", "heartbeat_missed"),
        ("te4", "restarting"), ("te4", "killed"), ("te4", "started"), ("te4", "recovered"),
        ("te4/worker0", "started")]
    events = h.events("te4")
    assert events[4]["details"]["how"] == "terminated"  # the host obeyed SIGTERM
    assert not _is_alive(events[1]["pid"])  # the stopped worker got SIGKILL first
    assert h.te_downs() == ["te4"]


def test_a_restarted_te_whose_worker_stalls_before_it_is_listed_is_hung_and_restarted(
        make_harness):
    # incarnation 0 crashes; 1 is a host whose worker stalls in its warm-up (it
    # is never listed); 2 behaves. Before, 1's worker went unheard until listed:
    # only the TE's own start timeout (60 s) ended it.
    h = make_harness()
    h.spawn("te6", lambda n: ("crash", "host:stall", "host:beat")[min(n, 2)], is_te=True)
    h.sup.start()
    h.wait_for("te6", "te6", "started", count=3)
    events = h.events("te6")
    assert [(e["component"], e["event"]) for e in events] == [
        ("te6", "started"), ("te6", "crashed"), ("te6", "restarting"), ("te6", "started"),
        ("te6/worker0", "started"), ("te6/worker0", "hung"), ("te6", "restarting"),
        ("te6", "killed"), ("te6", "started")]
    host, worker, hung = events[3], events[4], events[5]
    assert hung["pid"] == worker["pid"] and hung["details"]["progress"] == {"steps": 7}
    detect_s = _epoch(hung) - h.fault_time("te6", 1)
    assert PROGRESS_S <= detect_s <= PROGRESS_S + SLACK_S, detect_s
    assert not _is_alive(worker["pid"]) and not _is_alive(host["pid"])
    assert h.te_downs() == ["te6", "te6"]


def test_events_are_forwarded_and_unknown_ones_dropped(make_harness):
    h = make_harness("je")
    h.spawn("je", "events")
    h.sup.start()
    fired = h.wait_for("je", "je", "fault_injected")[0]
    time.sleep(0.3)
    assert h.seq("je") == [("je", "started"), ("je", "fault_injected")]
    assert fired["details"] == {"fault": "stall", "value": ""}
    assert fired["pid"] == h.table.pid("je")


def test_a_deposed_heads_cm_and_je_are_stopped_for_good_not_as_a_fault(make_harness):
    """head_stepped_down from the cluster manager: the supervisor stops it and
    the job executor, restarts neither, and counts no failure (a node that
    stops on a failed vital process must not stop for this)."""
    h = make_harness("cluster-manager", "job-executor", "gateway")
    h.spawn("job-executor", "beat")
    h.spawn("gateway", "beat")
    h.spawn("cluster-manager", "deposed")
    h.sup.start()
    h.wait_for("cluster-manager", "cluster-manager", "head_stepped_down")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            h.table.poll(n) is None for n in ("cluster-manager", "job-executor")):
        time.sleep(0.05)
    assert h.table.poll("cluster-manager") is not None and h.table.poll("job-executor") is not None
    time.sleep(HEARTBEAT_S + SLACK_S)  # past every deadline: nothing is missed or restarted
    assert h.sup.retired == {"cluster-manager", "job-executor"} and not h.sup.failed
    for name in ("cluster-manager", "job-executor"):
        assert [event for _, event in h.seq(name)] == (
            ["started", "head_stepped_down"] if name == "cluster-manager" else ["started"])
    assert h.table.poll("gateway") is None  # the rest runs on


def test_an_order_of_a_deposed_heads_term_is_refused(make_harness):
    """A ScaleOut / ScaleIn below the highest term this node heard was sent by a
    head that has since been deposed (before it stepped down): dropped, said."""
    from deepserve.ipc.sockets import PushSocket
    from deepserve.messages.scaling import ScaleIn, ScaleOut
    h = make_harness()
    h.sup.fence.highest = 2  # heard: term 2
    h.sup.start()
    push = PushSocket(h.ctx, h.env[HEARTBEAT_ENV], bind=False)
    try:
        push.put(ScaleOut(model="m", count=1, term=1), timeout=2)  # the fault
        push.put(ScaleIn(te_id="m-0", model="m", term=1), timeout=2)
        push.put(ScaleOut(model="m", count=1, term=2), timeout=2)  # the current head's
        refused = h.wait_for("node", "node", "scale_refused", count=2)
        time.sleep(0.3)
        assert len(h.events("node")) == 2  # not the current head's order
        assert all(e["details"]["term"] == 1 and "deposed" in e["details"]["reason"]
                   for e in refused)
    finally:
        push.close()
