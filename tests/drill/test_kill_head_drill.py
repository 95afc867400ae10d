"""kill-head: the drill's aim and proof (fast), then the drill as an operator
runs it (bin/deepserve-drill kill-head): a head (cluster manager, job executor,
gateway) on 127.0.0.1 as a process, a standby head on 127.0.0.2 whose gateway
takes the load, n2 on 127.0.0.3 joined to both; the head is SIGKILLed whole."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from deepserve.drill.health_events import HealthEvents
from deepserve.drill.proof import HeadLost
from deepserve.drill.scenarios import deadline_of, get_scenario
from deepserve.drill.target import aim
from deepserve.supervisor.health_log import HealthLog
from tests.drill.cluster_drill import run_cluster_drill
from tests.scratch import Scratch


def test_the_target_is_the_head_and_the_deadline_the_failover():
    s = get_scenario("kill-head")
    assert s.kills_node and s.kills_head and s.conf == "cluster-head.toml"
    assert aim(s, None, {}, cluster=type("C", (), {"node_tes": {"head": []}})) == (
        "head", ["head"])
    assert deadline_of(s, None, te_timeout_s=5.0, failover_s=2.5) == 2.5


def test_the_proof_needs_the_pids_gone_and_the_standbys_take_over(tmp_path):
    t0 = time.time()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with HealthLog(tmp_path / "health.jsonl", "s1") as hl:
            hl.write("cluster-manager", "head_lost", None, head="h:1", silent_s=4.0)
        events = HealthEvents(tmp_path)
        unseen = HeadLost(events, [gone.pid], t0 - 1)
        unseen.finish([])  # the head went silent, but nobody took over
        assert not unseen.is_proven and "head_taken_over seen False" in unseen.failure
        with HealthLog(tmp_path / "health.jsonl", "s1") as hl:
            hl.write("cluster-manager", "head_taken_over", 7, head="h:1", cm="tcp://s:1")
        living = HeadLost(events, [gone.pid, alive.pid], t0 - 1)
        living.finish([])  # one of the head's processes lives on
        assert not living.is_proven and "pids gone False" in living.failure
        proven = HeadLost(events, [gone.pid], t0 - 1)
        proven.poll(time.time())
        assert proven.is_proven and any("took over" in e for e in proven.evidence)
    finally:
        alive.kill()
        alive.wait(30)


@pytest.mark.slow
def test_kill_head_drill_loses_nothing(tmp_path, tiny_model):
    """The drill's verdict from its JSON: the head killed (proof: its pids gone,
    the standby's head_taken_over), lost = 0, bad = 0 for every request sent
    through the standby's gateway (the one in flight at the kill resumed at the
    new JE, the ones sent meanwhile held until it took them); detection within
    failover_s (+ a supervisor tick); the window with no service printed; the
    head's leftovers gone."""
    scratch = Scratch()
    try:
        done, report = run_cluster_drill("kill-head", ("cluster-head", "cluster-node"),
                                         tmp_path, tiny_model, scratch)
        assert "the standby took over" in report["proof"], report
        assert report["detect_s"] <= report["deadline_s"] + 0.5, report
        [window] = re.findall(r"no service for ([\d.]+) s", done.stdout)
        assert 0 < float(window) <= 10.0, done.stdout[-3000:]
        assert scratch.runs and scratch.leftovers() == set(), scratch.runs
    finally:
        scratch.close()
        scratch.sweep()
        scratch.remove_dir()
