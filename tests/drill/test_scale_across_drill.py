"""scale-across: the drill's aim and proof (fast), then the drill as an
operator runs it (bin/deepserve-drill scale-across): a head without devices
and two capacity-only nodes on 127.0.0.1-3 (conf/cluster-scaled-*.toml); the
model's first TE starts on a joined node, which is SIGKILLed whole under load."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepserve.config.models import ModelSpec
from deepserve.drill.health_events import HealthEvents
from deepserve.drill.proof import NodeLost
from deepserve.drill.scenarios import get_scenario
from deepserve.drill.target import aim, placed_target
from deepserve.supervisor.health_log import HealthLog
from tests.drill.cluster_drill import run_cluster_drill
from tests.scratch import Scratch

ROOT = Path(__file__).resolve().parents[2]


class _Config:
    models = (ModelSpec(name="deepserve-tiny", path="/m", min_tes=0),)


def test_the_target_is_the_node_the_head_placed_the_first_te_on(tmp_path):
    s = get_scenario("scale-across")
    assert s.kills_node and s.scales_across and s.node_conf == "cluster-scaled-node.toml"
    assert aim(s, None, {}, cluster=type("C", (), {"node_tes": {"n1": [], "n2": []}})) == ("", [])
    with HealthLog(tmp_path / "health.jsonl", "head") as hl:
        hl.write("cluster-manager", "scale_decision", 1, model="deepserve-tiny", placed={})
        hl.write("cluster-manager", "scale_decision", 1, model="other", placed={"n1": 1})
        hl.write("cluster-manager", "scale_decision", 1, model="deepserve-tiny",
                 placed={"n2": 1})
    assert placed_target(HealthEvents(tmp_path), _Config, "deepserve-tiny") == (
        "n2", "n2-deepservet-0")
    with pytest.raises(RuntimeError, match="no scale-out of absent"):
        placed_target(HealthEvents(tmp_path), _Config, "absent")


def test_the_proof_also_needs_the_cms_node_lost(tmp_path):
    t0 = time.time()
    with HealthLog(tmp_path / "health.jsonl", "head") as hl:
        hl.write("cluster-manager", "te_removed", 1, te_id="n2-m-0", reason="no report")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    events = HealthEvents(tmp_path)
    unseen = NodeLost(events, ["n2-m-0"], [gone.pid], t0 - 1, node="n2")
    unseen.finish([])
    assert not unseen.is_proven and "node_lost seen False" in unseen.failure
    with HealthLog(tmp_path / "health.jsonl", "head") as hl:
        hl.write("cluster-manager", "node_lost", 1, node="n1", tes=[])  # another node
    other = NodeLost(events, ["n2-m-0"], [gone.pid], t0 - 1, node="n2")
    other.finish([])
    assert not other.is_proven
    with HealthLog(tmp_path / "health.jsonl", "head") as hl:
        hl.write("cluster-manager", "node_lost", 1, node="n2", tes=["n2-m-0"])
    proven = NodeLost(events, ["n2-m-0"], [gone.pid], t0 - 1, node="n2")
    proven.poll(time.time())
    assert proven.is_proven and any("node n2 lost" in e for e in proven.evidence)


@pytest.mark.slow
def test_scale_across_drill_loses_nothing(tmp_path, tiny_model):
    """The drill's verdict from its JSON: the model scaled from zero onto a
    joined node, that node was killed (proof: pids gone, TE removed, node
    lost), the TE came back on the other node, lost = 0, bad = 0; and the
    killed node's leftovers are gone."""
    scratch = Scratch()
    try:
        done, report = run_cluster_drill("scale-across", ("cluster-scaled-head",
                                                          "cluster-scaled-node"),
                                         tmp_path, tiny_model, scratch)
        [killed] = re.findall(r"node (n\d) lost", report["proof"])
        other = "n1" if killed == "n2" else "n2"  # the TE placed there after the fault:
        assert re.search(r'\+[\d.]+ cluster-manager scale_decision .*"placed": \{"%s": 1\}'
                         % other, done.stdout), done.stdout[-3000:]
        assert scratch.runs and scratch.leftovers() == set(), scratch.runs
    finally:
        scratch.close()
        scratch.sweep()
        scratch.remove_dir()
