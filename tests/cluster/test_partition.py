"""`bin/deepserve-drill partition-head` (drill/partition.py), as an operator runs
it: two live heads, one term. The drill starts three hosts (network namespaces)
of its own, cuts the link between the head and its standby while the third node
reaches both, heals it, and reports; this test reads that report and checks
that the nodes left nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepserve.drill.netns import unavailable_reason
from tests.scratch import Scratch

pytestmark = pytest.mark.slow  # three nodes' process trees

ROOT = Path(__file__).resolve().parents[2]


def test_a_partitioned_head_steps_down_and_nothing_is_served_twice(tmp_path, tiny_model):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the partition drill needs network namespaces: {reason}")
    conf = tmp_path / "head.toml"  # the shipped head conf, on the test's model
    conf.write_text((ROOT / "conf" / "cluster-head.toml").read_text()
                    .replace('"models/tiny"', f'"{tiny_model}"'))
    out, scratch = tmp_path / "report.json", Scratch()
    try:
        done = subprocess.run([sys.executable, "-m", "deepserve.drill", "partition-head",
                               "--conf", str(conf), "--json", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=500, env=scratch.env())
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        report = json.loads(out.read_text())
        # the fault happened and was seen on both sides, the standby took term 2
        assert report["proven"] is True, report["proof"]
        assert "h0 saw h1's TE go silent" in report["proof"]
        assert "state_dir/terms/2 names h1" in report["proof"]
        assert 0 < report["taken_over_s"] < report["stepped_down_s"] < 60, report
        assert report["sent"] == 16 and report["lost"] == 0 and report["bad_streams"] == 0
        assert report["delivered_twice"] == 0 and report["heads_at_end"] == 1, report
        # generated twice (an old attempt's tokens that reached the gateway after its
        # stream resumed elsewhere): reported, dropped, never delivered
        assert report["served_twice"] >= report["delivered_twice"]
        assert (report["late_tokens"] > 0) == (report["served_twice"] > 0), report
        scratch.close()
        assert scratch.runs and scratch.leftovers() == set(), scratch.leftovers()
    finally:
        scratch.close()
        scratch.sweep()
        scratch.remove_dir()


def test_the_drill_refuses_to_run_without_namespaces_and_says_why(tmp_path):
    """No root here (a user that may not make namespaces): exit 2 naming the reason."""
    if sys.platform != "linux":
        pytest.skip("Linux only")
    done = subprocess.run([sys.executable, "-c", (
        "import os, sys; os.geteuid = lambda: 1000; sys.argv = ['drill', 'partition-head']; "
        "from deepserve.drill.__main__ import main; main()")], cwd=ROOT, capture_output=True,
        text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs root" in done.stderr, done.stderr
