"""kill-node: the proof on our own throwaway processes (fast), then the drill
as an operator runs it (bin/deepserve-drill kill-node): a head and two joined
nodes on 127.0.0.1-3, one node SIGKILLed whole under load."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepserve.drill.health_events import HealthEvents
from deepserve.drill.injection import Injection
from deepserve.drill.proof import NodeLost
from deepserve.drill.scenarios import deadline_of, get_scenario
from deepserve.supervisor.health_log import HealthLog
from tests.drill.cluster_drill import run_cluster_drill
from tests.scratch import Scratch

ROOT = Path(__file__).resolve().parents[2]


def test_kill_node_scenario_and_its_deadline():
    s = get_scenario("kill-node")
    assert s.kills_node and not s.is_signal and not s.restarts and s.conf == "cluster-head.toml"
    sup = SimpleNamespace(heartbeat_deadline_s=1.5, progress_deadline_s=7.0)
    assert deadline_of(s, sup, te_timeout_s=4.0) == 4.0  # the CM's, not the supervisor's
    assert not get_scenario("kill-worker").kills_node
    with pytest.raises(RuntimeError, match="cluster the drill starts"):
        Injection(s, "n2", ["n2-te0"]).inject(None, None)


def test_node_lost_needs_every_pid_gone_and_every_te_removed(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        t0 = time.time()
        with HealthLog(tmp_path / "health.jsonl", "head") as hl:
            hl.write("cluster-manager", "te_removed", 1, te_id="n2-te0", reason="no report")
            hl.write("cluster-manager", "te_removed", 1, te_id="n1-te0", reason="shutdown")
        events = HealthEvents(tmp_path)
        pids = [p.pid for p in procs]
        alive = NodeLost(events, ["n2-te0"], pids, t0 - 1)
        alive.finish([])
        assert not alive.is_proven and "pids gone False" in alive.failure
        for p in procs:
            p.kill()
            p.wait(5)
        one_missing = NodeLost(events, ["n2-te0", "n2-te1"], pids, t0 - 1)
        one_missing.finish([])
        assert not one_missing.is_proven and "n2-te1" in one_missing.failure
        stale = NodeLost(events, ["n2-te0"], pids, t0 + 60)  # removed before the fault
        stale.finish([])
        assert not stale.is_proven
        proven = NodeLost(events, ["n2-te0"], pids, t0 - 1)
        proven.poll(time.time())
        assert proven.is_proven and proven.is_settled
        assert any("n2-te0 removed: no report" in e for e in proven.evidence)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)


@pytest.mark.slow
def test_kill_node_drill_loses_nothing(tmp_path, tiny_model):
    """The drill's own verdict, read from its JSON: the node's processes were
    killed and its TE removed (proof), then lost = 0, bad = 0; and what the
    killed node could not clean up is gone too."""
    scratch = Scratch()
    try:
        _, report = run_cluster_drill("kill-node", ("cluster-head", "cluster-node"), tmp_path,
                                      tiny_model, scratch)
        assert report["detect_s"] is not None and report["detect_s"] <= report["deadline_s"] + 3
        assert scratch.runs and scratch.leftovers() == set(), scratch.runs
    finally:
        scratch.close()
        scratch.sweep()
        scratch.remove_dir()


def test_kill_node_without_its_model_fails_at_once(tmp_path):
    """A node conf whose model is missing: exit 2 naming it, before any process starts
    (a joined node would die at once and the head wait out its startup timeout)."""
    text = (ROOT / "conf" / "cluster-node.toml").read_text()
    (tmp_path / "node.toml").write_text(text.replace('"models/tiny"', '"/nonexistent/m"'))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "deepserve.drill", "kill-node", "--node-conf",
                           str(tmp_path / "node.toml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "no model at" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 60
