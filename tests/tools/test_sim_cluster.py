"""tools/sim_cluster.py: small simulations that drive the real router, PD policy
and scaling loop (a few hundred requests each, a second or less)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepserve.cache.block_hash import prompt_block_hashes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))  # the simulator's modules import each other by name
import sim_cluster  # noqa: E402
import sim_model  # noqa: E402

COLOCATED = dict(num_models=1, mix=(1, 0, 0), pd_mode="colocated")


def run(**options):
    sim = sim_cluster.ClusterSim(sim_cluster.SimConfig(**options))
    return sim, sim.run()


def test_every_request_completes_exactly_once():
    sim, r = run(num_tes=16, num_models=2, num_requests=300)
    assert r["num_finished"] == 300 and r["num_lost"] == 0
    assert len(sim.stats.finished) == 300 and set(sim.stats.finished.values()) == {1}
    assert r["num_decisions"] == 300  # no job routed twice
    assert r["num_reports"] > 0 and r["index_hashes"] > 0  # the router's index was fed
    assert r["layouts"].get("disaggregated", 0) > 0  # the heatmap sent jobs to PD pairs


def test_later_turns_stick_to_their_prefix_and_beat_round_robin():
    _, combined = run(num_tes=16, num_requests=300, policy="combined", **COLOCATED)
    _, rr = run(num_tes=16, num_requests=300, policy="round_robin", **COLOCATED)
    assert combined["hit_rate"] > rr["hit_rate"]
    assert combined["later_turn_same_te"] > 3 * combined["later_turn_chance"]
    assert combined["later_turn_same_te"] > rr["later_turn_same_te"]
    assert combined["rules"].get("locality", 0) > 0 and rr["matched_rate"] == 0


def test_autoscaler_adds_tes_under_a_burst_and_not_without():
    profile = sim_model.Profile(max_batch=4)
    calm, calm_r = run(num_tes=8, num_requests=800, profile=profile, **COLOCATED)
    burst, burst_r = run(num_tes=8, num_requests=800, profile=profile, burst=(5.0, 30.0, 20.0),
                         **COLOCATED)
    assert calm_r["tes_listed"]["start"] == burst_r["tes_listed"]["start"] == 8
    assert calm_r["num_scale_out"] == 0 and calm_r["tes_listed"]["max"] == 8
    assert burst_r["num_scale_out"] > 0 and burst_r["tes_listed"]["max"] > 8
    assert len(burst.router.tes) > 8  # the JE's TE list grew
    started = {te for te in burst.router.num_finished if int(te.split("-c")[1]) > 8}
    assert started  # a started TE served requests
    assert burst_r["num_finished"] == 800 and burst_r["num_lost"] == 0


def test_sim_hashes_are_the_routers():
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(16 * 7 + 5)]
    head = sim_model.extend_hashes(tokens[:40], [], 16)
    assert sim_model.extend_hashes(tokens, head, 16) == prompt_block_hashes(tokens, 16)


def test_profile_rejects_unknown_keys(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"prefill_s_per_token": 2e-4}))
    assert sim_model.Profile.load(path).prefill_s_per_token == 2e-4
    path.write_text(json.dumps({"prefill_per_token": 2e-4}))
    with pytest.raises(ValueError, match="prefill_per_token"):
        sim_model.Profile.load(path)


def test_cli_prints_the_table_and_writes_the_json(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(sim_cluster.main, [
        "--te-counts", "8,16", "--models", "2", "--requests", "120", "--no-pin",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[1].startswith("TEs | dec/s") and [ln.split(" | ")[0] for ln in lines[2:]] == [
        "8", "16"]
    data = json.loads(out.read_text())
    assert data["config"]["num_tes"] == [8, 16] and len(data["runs"]) == 2
    for row in data["runs"]:
        for key in ("decisions_per_s", "decisions_per_cpu_s", "decision_us", "hit_rate",
                    "jct_p50_s", "jct_p90_s", "push_bytes", "push_codec_us", "update_tes_us",
                    "index_hashes", "match_us", "hash_us", "events_per_s"):
            assert row[key] is not None and row[key] > 0, key
        assert row["num_finished"] == 120
    assert data["runs"][1]["push_bytes"] > data["runs"][0]["push_bytes"]  # grows with TEs
