"""A node-killing drill as an operator runs it (`python -m deepserve.drill
SCENARIO`) on the shipped cluster confs pointed at the test's model; the
tests read its verdict from the JSON and its timeline from stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.scratch import Scratch

ROOT = Path(__file__).resolve().parents[2]


def run_cluster_drill(scenario: str, confs: tuple[str, str], tmp_path: Path, model: Path,
                      scratch: Scratch) -> tuple[subprocess.CompletedProcess, dict]:
    """(the finished drill, its JSON report); confs: the head's and the nodes'
    conf/ names, copied with their model replaced by `model`."""
    paths = []
    for name in confs:
        text = (ROOT / "conf" / f"{name}.toml").read_text()
        (tmp_path / f"{name}.toml").write_text(text.replace('"models/tiny"', f'"{model}"'))
        paths.append(str(tmp_path / f"{name}.toml"))
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "deepserve.drill", scenario, "--json",
                           str(out), "--duration", "6", "--concurrency", "4",
                           "--conf", paths[0], "--node-conf", paths[1]],
                          cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env=scratch.env())
    scratch.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "under keys of its own" in done.stderr  # the shipped cluster confs are secure
    report = json.loads(out.read_text())
    assert report["fault_proven"] is True, report
    assert report["sent"] > 0 and report["lost"] == 0 and report["bad_streams"] == 0, report
    assert report["recover_s"] is not None, report
    return done, report
