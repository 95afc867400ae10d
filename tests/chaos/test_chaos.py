"""bin/deepserve-chaos: the seeded schedule, duration parsing, the checker,
resource growth (no node); then one short run for real (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepserve.chaos.checks import (BAD, EXPECTED, HOSTILE_ACCEPTED, OK, TYPED, UNTYPED, Oracle,
                                    explain_cuts, tally)
from deepserve.chaos.faults import shares_hooks
from deepserve.chaos.report import is_ok, rates
from deepserve.chaos.resources import Sample, component_of, growth, growth_after_s, shm_bytes
from deepserve.chaos.schedule import (GAP_S, SINGLE_NODE, PlannedFault, fault_menu,
                                      make_schedule, not_supported, parse_duration)
from deepserve.chaos.__main__ import scaling_of
from deepserve.chaos.workload import (CHAT, COMPLETION, HOSTILE, POISON, SCALED_BLOCK,
                                      SCALED_EVERY, RequestSpec, Workload)
from deepserve.drill.stream import CONNECTION_ERROR, COMPLETED, FAILED, LOST, RequestRecord

ROOT = Path(__file__).resolve().parents[2]
TYPES = {"te0": "colocated", "te1": "colocated"}


# --- schedule ---------------------------------------------------------------------------------

def test_same_seed_same_schedule_and_another_seed_another():
    menu = fault_menu(TYPES)
    a = make_schedule(7, 1800, menu, ["te0", "te1"])
    assert a == make_schedule(7, 1800, menu, ["te0", "te1"])
    assert a != make_schedule(8, 1800, menu, ["te0", "te1"])
    gaps = [b.at_s - a_.at_s for a_, b in zip(a, a[1:])]
    assert all(GAP_S[0] - 1e-3 <= g <= GAP_S[1] + 1e-3 for g in gaps), gaps
    assert a[-1].at_s <= 1800 - 15 and len(a) >= 1800 // 60 - 1
    assert {f.scenario for f in a} <= set(menu) and len({f.scenario for f in a}) > 3


def test_schedule_overlap_allowed_fixed_gap_and_targets():
    # a 5 s gap is shorter than any recovery: faults overlap; nothing serialises them
    faults = make_schedule(1, 60, ["kill-worker", "kill-je"], ["te0", "te1"], fault_every_s=5)
    assert [f.at_s for f in faults] == [5.0 * i for i in range(1, 10)]
    for f in faults:
        assert (f.te is None) == (f.scenario == "kill-je")
        assert f.te in (None, "te0", "te1")
    disk = make_schedule(1, 60, ["disk-full", "corrupt-disk"], ["te0"], fault_every_s=5)
    assert disk and all(f.te is None for f in disk)  # the node's disk tier, not a TE's
    with pytest.raises(ValueError):
        make_schedule(1, 60, [], ["te0"])


def test_faults_that_write_the_same_hook_files_are_not_overlapped():
    def f(scenario, te="te0"):
        return PlannedFault(0.0, scenario, te)
    assert shares_hooks(f("poison"), f("poison", "te1"))  # every TE of the type: one set
    assert shares_hooks(f("stall-worker"), f("stall-worker"))
    assert not shares_hooks(f("stall-worker"), f("stall-worker", "te1"))
    assert not shares_hooks(f("stall-worker"), f("slow-worker"))
    assert not shares_hooks(f("kill-worker"), f("kill-worker"))  # signals write no file
    assert not shares_hooks(f("kill-je", None), f("kill-je", None))
    assert shares_hooks(f("disk-full", None), f("disk-full", None))  # one tier, one hook
    assert shares_hooks(f("corrupt-disk", None), f("disk-full", None))  # one disk tier
    assert shares_hooks(f("corrupt-disk", None), f("corrupt-disk", None))


def test_menu_follows_the_node():
    assert "kv-transfer-fail" not in fault_menu(TYPES)
    assert "kv-transfer-fail" in fault_menu({**TYPES, "te2": "prefill", "te3": "decode"})
    assert "drop-cache" in fault_menu(TYPES)
    assert "drop-cache" not in fault_menu(TYPES, has_host_tier=True)
    assert "drop-cache" in not_supported(True) and "drop-cache" not in not_supported(False)
    assert "kill-gateway" in fault_menu(TYPES) and "kill-node" in not_supported(True)
    assert "kill-kv-tier" in not_supported(False) and "kill-kv-tier" not in not_supported(True)
    assert "kill-kv-tier" in fault_menu(TYPES, has_host_tier=True)  # a tier service to kill
    assert "kill-kv-tier" not in fault_menu(TYPES)
    assert fault_menu(TYPES, ["kill-je", "slow-worker"]) == ["slow-worker", "kill-je"]
    with pytest.raises(ValueError, match="kv-transfer-fail"):
        fault_menu(TYPES, ["kv-transfer-fail"])
    assert "disk-full" in not_supported(True) and "corrupt-disk" not in fault_menu(TYPES, None, True)
    assert {"disk-full", "corrupt-disk"} <= set(fault_menu(TYPES, None, True, has_disk_tier=True))
    assert "disk-full" not in not_supported(True, has_disk_tier=True)
    assert set(fault_menu({**TYPES, "te2": "prefill"})) == set(SINGLE_NODE) - {
        "kill-kv-tier", "disk-full", "corrupt-disk"}


def test_parse_duration():
    assert parse_duration("90") == 90.0 and parse_duration("90s") == 90.0
    assert parse_duration("30m") == 1800.0 and parse_duration("1h") == 3600.0
    assert parse_duration("1.5m") == 90.0 and parse_duration(" 2H ") == 7200.0
    assert parse_duration(45) == 45.0
    for bad in ("", "m", "10x", "-5", "0", "1h30m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


# --- workload ---------------------------------------------------------------------------------

def test_workload_is_seeded_and_mixed():
    w = Workload(3, "m", ["p0", "p1"], ["ka", "kb"])
    w.contexts = {(0, "ctx-prompt"): "ctx-a", (1, "ctx-prompt"): "ctx-b",
                  (0, "ctx-chat"): "ctx-c", (1, "ctx-chat"): "ctx-d"}
    specs = [w.spec(i) for i in range(400)]
    again = Workload(3, "m", ["p0", "p1"], ["ka", "kb"])
    again.contexts = dict(w.contexts)
    assert [again.spec(i) for i in range(400)] == specs  # the same seed, the same requests
    assert [Workload(4, "m", ["p0", "p1"], ["ka", "kb"]).spec(i) for i in range(50)] != specs[:50]
    kinds = {s.kind for s in specs}
    assert kinds == {CHAT, COMPLETION, HOSTILE}
    assert {s.stream for s in specs} == {True, False} and {s.n for s in specs} == {1, 2}
    assert {s.tenant for s in specs} == {0, 1} and any(s.context for s in specs)
    assert {s.key for s in specs if s.kind != HOSTILE} <= w.all_keys()
    path, body, headers = w.request(RequestSpec(1, COMPLETION, False, 2, 1, "ctx-prompt", 1))
    assert path == "/v1/completions" and body["n"] == 2 and body["context_id"] == "ctx-b"
    assert body["temperature"] == 0.0 and headers == {"Authorization": "Bearer kb"}
    _, raw, _ = w.request(RequestSpec(2, HOSTILE, False, hostile="malformed-json"))
    assert isinstance(raw, bytes)
    _, body, _ = w.request(RequestSpec(3, HOSTILE, False, tenant=0, hostile="foreign-context"))
    assert body["context_id"] == "ctx-b"  # tenant b's id, sent as tenant a
    assert {s.model for s in specs} == {0}  # no scaled model


def test_a_scaled_model_gets_blocks_of_requests_and_idles_between():
    plain = Workload(3, "m", ["p0", "p1"], ["ka"])
    w = Workload(3, "m", ["p0", "p1"], ["ka"], scaled_model="z")
    w.contexts = {(0, "ctx-prompt"): "ctx-a", (0, "ctx-chat"): "ctx-c"}
    plain.contexts = dict(w.contexts)
    n = SCALED_BLOCK * SCALED_EVERY * 2
    specs = [w.spec(i) for i in range(n)]
    to_z = [s for s in specs if s.model == 1]
    assert 0.1 < len(to_z) / (n / SCALED_EVERY) < 0.3  # about SCALED_SHARE of its blocks
    assert all((s.id // SCALED_BLOCK) % SCALED_EVERY == 0 for s in to_z)  # idle in between
    assert all(s.context is None for s in to_z)  # contexts are the node's model's
    # the model is drawn last: apart from it, the requests are those without a scaled model
    assert [s.__class__(**{**s.to_dict(), "model": 0}) for s in specs] == \
        [plain.spec(i) for i in range(n)]
    assert {s.key for s in specs if s.kind != HOSTILE} <= w.all_keys()
    assert {k[3] for k in w.all_keys()} == {0, 1}
    assert all(k[3] == 0 for k in w.all_keys() if k[2] is not None)
    _, body, _ = w.request(to_z[0])
    assert body["model"] == "z" and w.request(specs[1 + SCALED_BLOCK])[1]["model"] == "m"


def test_scaling_of_counts_the_models_trips_to_zero_and_back():
    def decision(model, direction, reason):
        return {"event": "scale_decision", "details": {"model": model, "direction": direction,
                                                       "reason": reason}}
    events = [decision("z", "out", "demand_from_zero"), decision("z", "in", "idle"),
              decision("z", "out", "queue"), decision("m", "in", "idle"),
              {"event": "started", "details": {}}, decision("z", "out", "demand_from_zero")]
    assert scaling_of("z", events) == {"model": "z", "decisions": 4, "to_zero": 1,
                                       "from_zero": 2}


# --- checks -----------------------------------------------------------------------------------

REF = [5, 6, 7, 8]


def _record(status=COMPLETED, choices=None, usage=None, **kw) -> RequestRecord:
    choices = {0: list(REF)} if choices is None else choices
    r = RequestRecord(id=0, prompt_index=0, max_tokens=4, start=0.0, end=1.0, status=status,
                      usage=usage, **kw)
    for i, ids in choices.items():
        r.choice_ids[i] = list(ids)
        r.token_ids.extend(ids)
        if status == COMPLETED:
            r.finish_reasons[i] = "length"
    return r


def _oracle() -> Oracle:
    return Oracle({(COMPLETION, 0, None, 0): list(REF)})


SPEC = RequestSpec(0, COMPLETION)


def test_checker_ok_repeated_token_mismatch_and_lost():
    o = _oracle()
    assert o.check(SPEC, _record()).outcome == OK
    repeated = o.check(SPEC, _record(choices={0: [5, 6, 6, 7]}))  # a token sent twice
    assert repeated.outcome == BAD and "token 2 is 6" in repeated.reason
    resent = o.check(SPEC, _record(status=FAILED, choices={0: [5, 6, 5, 6]},
                                   error_type="service_unavailable"))
    assert resent.outcome == BAD  # a failed stream is still bad if its ids are wrong
    assert o.check(SPEC, _record(choices={0: [5, 6, 7, 9]})).outcome == BAD  # mismatched
    assert o.check(SPEC, _record(choices={0: [5, 6]})).outcome == BAD  # completed short
    lost = _record(status=LOST, choices={0: [5]})
    lost.end = None
    assert o.check(SPEC, lost).outcome == LOST  # no end: lost, whatever it had
    usage = o.check(SPEC, _record(usage={"completion_tokens": 3}))
    assert usage.outcome == BAD and "usage" in usage.reason


def test_checker_n_choices_failures_hostile_and_poison():
    o = _oracle()
    two = RequestSpec(0, COMPLETION, n=2)
    assert o.check(two, _record(choices={0: REF, 1: REF})).outcome == OK
    assert o.check(two, _record(choices={0: REF, 1: [5, 6, 7, 1]})).outcome == BAD
    assert "choice 1" in o.check(two, _record(choices={0: REF})).reason  # a choice missing
    assert o.check(SPEC, _record(choices={0: REF, 1: REF})).outcome == BAD  # past n
    typed = _record(status=FAILED, choices={0: [5, 6]}, error_type="service_unavailable")
    assert o.check(SPEC, typed).outcome == TYPED  # a correct prefix, then a typed error
    cut = _record(status=FAILED, choices={0: [5]}, error_type="connection_error")
    assert o.check(SPEC, cut).outcome == UNTYPED
    hostile = RequestSpec(1, HOSTILE, False, hostile="bad-n")
    refused = _record(status=FAILED, choices={}, http_status=400, error_type="invalid_request_error")
    assert o.check(hostile, refused).outcome == EXPECTED
    assert o.check(hostile, _record(http_status=200)).outcome == HOSTILE_ACCEPTED
    server = _record(status=FAILED, choices={}, http_status=500, error_type="server_error")
    assert o.check(hostile, server).outcome == HOSTILE_ACCEPTED
    plain = _record(status=FAILED, choices={}, http_status=422, error_type="http_error")
    assert o.check(hostile, plain).outcome == HOSTILE_ACCEPTED  # no OpenAI error body
    poison = _record(status=FAILED, choices={}, error_type="server_error",
                     error_code="request_crashed_engine")
    assert o.check(RequestSpec(-1000, POISON), poison).outcome == EXPECTED
    with pytest.raises(RuntimeError):
        o.add((CHAT, 0, None, 0), _record(status=FAILED))


def test_connection_failures_while_a_killed_gateway_was_down_are_expected():
    def failed(start, end, error_type):
        r = _record(status=FAILED, choices={})
        r.start, r.end, r.error_type, r.error = start, end, error_type, "x"
        return r
    o = _oracle()
    records = [failed(9.0, 10.5, CONNECTION_ERROR),  # open when the gateway died at 10
               failed(11.0, 11.0, CONNECTION_ERROR),  # refused while it was down
               failed(13.0, 13.1, CONNECTION_ERROR),  # after it served again (12): not it
               failed(10.5, 10.6, "service_unavailable")]  # typed: another story
    verdicts = [o.check(SPEC, r) for r in records]
    assert [v.outcome for v in verdicts] == [UNTYPED, UNTYPED, UNTYPED, TYPED]
    explained = explain_cuts(records, verdicts, [(10.0, 12.0)])
    assert [v.outcome for v in explained] == [EXPECTED, EXPECTED, UNTYPED, TYPED]
    assert explained[0].reason == "cut by a gateway kill: connection_error"
    assert explain_cuts(records, verdicts, []) == verdicts  # no gateway kill, no excuse


def test_tally_partitions_by_status():
    o = _oracle()
    records = [_record(), _record(choices={0: [5, 6, 6, 7]}),
               _record(status=FAILED, choices={0: [5]}, error_type="timeout"),
               _record(status=LOST, choices={})]
    counts = tally([o.check(SPEC, r) for r in records], records)
    assert (counts["sent"], counts["completed"], counts["failed"], counts["lost"]) == (4, 2, 1, 1)
    assert counts["bad_streams"] == 1 and counts["mismatched"] == 1
    assert counts["failed_typed_by_type"] == {"timeout": 1}
    report = {**counts, "faults": [{"proven": True}]}
    assert not is_ok(report)
    assert is_ok({**report, "lost": 0, "bad_streams": 0})
    assert not is_ok({**report, "lost": 0, "bad_streams": 0, "faults": [{"proven": False}]})
    assert rates(records[:3], 0.0, COMPLETED) == [[0.0, 2, 1]]


# --- resources --------------------------------------------------------------------------------

def _sample(t, rss, fds, shm=0, comps=None):
    return Sample(t=t, rss_bytes=rss, num_fds=fds, num_procs=3, shm_bytes=shm, disk_bytes=0,
                  by_component=comps or {"te0": [rss, fds, 3]})


def test_growth_after_the_first_third():
    samples = [_sample(0, 100, 10), _sample(10, 150, 12), _sample(20, 160, 12, 4096),
               _sample(30, 200, 15, 8192, {"te0": [210, 16, 3], "gateway": [50, 5, 1]})]
    assert growth_after_s(30) == 10 and growth_after_s(7200) == 600
    g = growth(samples, growth_after_s(30))
    assert (g["from_s"], g["to_s"], g["shm_bytes"]) == (10, 30, 8192)
    # the gateway, in one sample of three, is transient: not counted
    assert g["by_component"] == {"te0": {"rss_bytes": 60, "num_fds": 4}}
    assert (g["rss_bytes"], g["num_fds"]) == (60, 4)  # the components' sums
    assert growth(samples, 31) == {}


def test_growth_skips_a_te_caught_mid_restart():
    # seen in a chaos run: te1 was its bare host (40 MiB, 1 process) at the first
    # counted sample and whole (840 MiB, 6 processes) at the end: +800 MiB read as
    # a leak; and a TE with a pod being adopted (7 processes) is no leak either
    te = {0: [840, 177, 6], 10: [40, 9, 1], 20: [842, 177, 6], 30: [900, 200, 7],
          40: [845, 178, 6], 50: [41, 9, 1]}
    samples = [_sample(t, 0, 0, comps={"te1": v}) for t, v in te.items()]
    # and a scaled model's TE that started small and loaded (one of many names)
    samples[2].by_component["deepservet-7"] = [40, 9, 1]
    samples[3].by_component["deepservet-7"] = [840, 177, 6]
    g = growth(samples, 10)
    assert g["by_component"] == {"te1": {"rss_bytes": 3, "num_fds": 1}}  # 842 -> 845
    assert (g["rss_bytes"], g["num_fds"]) == (3, 1)


def test_shm_bytes_and_components(tmp_path):
    (tmp_path / "deepserve-abc-x").write_bytes(b"\1" * 8192)
    (tmp_path / "deepserve-other").write_bytes(b"\1" * 4096)
    assert shm_bytes(["deepserve-abc"], str(tmp_path)) >= 8192
    assert shm_bytes(["deepserve-abc"], str(tmp_path)) < 8192 + 4096
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                             "--te-id", "te7"])
    try:
        import os
        import time
        import psutil
        child = psutil.Process(proc.pid)
        deadline = time.monotonic() + 10  # until it has exec'd: before that a forked
        while "--te-id" not in child.cmdline() and time.monotonic() < deadline:  # child
            time.sleep(0.01)  # still shows pytest's argv (seen once in CI under load)
        assert component_of(child, os.getpid()) == "te7"
        assert component_of(psutil.Process(os.getpid()), os.getpid()) == "node"
        # the process table's name wins (an adopted pod is its TE's)
        assert component_of(psutil.Process(proc.pid), os.getpid(), {proc.pid: "te1"}) == "te1"
    finally:
        proc.kill()
        proc.wait(10)


# --- for real ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_chaos_run(tmp_path, tiny_model):
    """50 s of load with a fault every 8 s from four cheap kinds (the JE and
    the KV tier service restart in seconds; a full disk and corrupt block
    files restart nothing): nothing lost, no bad stream, every fault proven,
    the report's schema, /dev/shm clean, the second model woken from zero.
    About 85 s on a quiet 2-core machine (the node's start is half of it)."""
    menu = ["kill-je", "kill-kv-tier", "disk-full", "corrupt-disk"]
    seed = next(s for s in range(200)
                if len({f.scenario for f in make_schedule(s, 50, menu, ["te0", "te1"], 8)})
                == 4)
    out, png = tmp_path / "chaos.json", tmp_path / "chaos.png"
    conf = tmp_path / "chaos.toml"  # the shipped file, on the test's model
    text = (ROOT / "conf" / "chaos.toml").read_text()
    assert '"models/tiny"' in text and '"var/chaos-kvcache"' in text
    conf.write_text(text.replace('"models/tiny"', f'"{tiny_model}"')
                    .replace('"var/chaos-kvcache"', f'"{tmp_path / "kvcache"}"'))
    proc = subprocess.run(
        [sys.executable, "-m", "deepserve.chaos", "--duration", "50", "--seed", str(seed),
         "--conf", str(conf),
         "--faults", ",".join(menu), "--fault-every", "8", "--sample-every", "5",
         "--json", str(out), "--png", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    print(proc.stdout, proc.stderr[-4000:])
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("sent", "completed", "failed", "lost", "bad_streams", "seed", "duration_s",
                "faults", "resources", "shm", "rates", "not_supported", "ok"):
        assert key in report, key
    assert report["seed"] == seed and report["duration_s"] == 50
    assert report["sent"] == report["completed"] + report["failed"] + report["lost"]
    assert report["lost"] == 0 and report["bad_streams"] == 0, report["examples"]
    assert report["hostile_accepted"] == 0, report["examples"]
    assert report["completed"] > 0 and report["by_kind"]["chat"]["completed"] > 0
    assert report["by_model"]["deepserve-tiny-zero"]["completed"] > 0  # the scaled model
    assert report["scaling"]["from_zero"] >= 1, report["scaling"]  # the oracle woke it
    assert len(report["faults"]) >= 2
    assert {f["kind"] for f in report["faults"]} == set(menu)
    for f in report["faults"]:
        assert set(f) >= {"kind", "at_s", "proven", "detect_s", "recover_s"}
        assert f["proven"] is True, f
        assert f["recover_s"] is not None, f
        if f["kind"] in ("kill-je", "kill-kv-tier", "disk-full", "corrupt-disk"):
            assert f["detect_s"] is not None, f
    samples = report["resources"]["samples"]
    assert len(samples) >= 5 and all(s["rss_bytes"] > 0 and s["num_fds"] > 0 for s in samples)
    assert "growth" in report["resources"]
    assert report["shm"]["back_to_baseline"] is True
    try:  # the PNG needs the bench extra (bin/deepserve-chaos installs it; CI's test extra not)
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 10_000
    except ImportError:
        assert not png.exists() and "no PNG: No module named 'matplotlib'" in proc.stderr
    assert proc.returncode == 0 and report["ok"] is True
