"""Drills: scenario selection, health-log parsing, fault injection on our own
throwaway processes, the CLI's exit code (fast, no node); then every scenario
for real, in sequence against one node started from conf/drill.toml.

Bounds of the real drills (deadline_s = the scenario's configured deadline,
conf/drill.toml: heartbeat 3 s for kill-* / hang-worker, progress 4 s for
stall-worker):
- detect_s <= 2 * deadline_s + 2: the deadline counts from the last heartbeat /
  last progress, which may precede the fault by up to one heartbeat interval,
  plus one watchdog check period; doubling covers both with room, +2 s for a
  loaded 2-core machine.
- recover_s <= that + kill_grace_s + RESTART_DELAY_S + TE_START_S: the
  supervisor stops the faulty TE (SIGTERM, SIGKILL after kill_grace_s), waits
  its restart backoff (restart_base_delay_s, doubled per attempt within
  restart_window_s: 2 s covers the 3rd attempt with conf/drill.toml's 0.5 s),
  and the replacement TE starts a Python process, loads the model and serves a
  warm-up request: 16-26 s measured on a shared 2-core machine, once 40 s;
  TE_START_S = 45 leaves room for a busy machine.
Every drill: the fault proven first (its fault_injected event, or the
detection of the signalled pid; drop-cache: the probe missed the cache;
kv-transfer-fail: a request resumed and completed), then lost == 0 and
bad_streams == 0 (failed requests are allowed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from click.testing import CliRunner

from deepserve.drill import __main__ as drill_main
from deepserve.drill import prompts as drill_prompts
from deepserve.drill.health_events import HealthEvents
from deepserve.drill.injection import Injection, current_pid, hook_path
from deepserve.drill.proof import (CacheMissed, HookFired, Logged, Proofs, SignalDetected,
                                   TransferResumed)
from deepserve.drill.report import KEYS, build_report
from deepserve.drill.runner import run_drill
from deepserve.drill.scenarios import (DETECT_EVENTS, SCENARIOS, deadline_of, get_scenario,
                                       target_te, target_tes)
from deepserve.drill.stream import COMPLETED, RequestRecord
from deepserve.ipc.sockets import free_port
from deepserve.supervisor.health_log import HealthLog

ROOT = Path(__file__).resolve().parents[2]
DRILL_CONF = ROOT / "conf" / "drill.toml"
TE_START_S = 45.0
RESTART_DELAY_S = 2.0


# --- no node ---------------------------------------------------------------------------------

def test_scenarios_by_name_alias_and_mode():
    assert set(SCENARIOS) == {"kill-worker", "kill-master", "kill-tokenizer", "hang-worker",
                              "stall-worker", "slow-worker", "drop-cache", "kv-transfer-fail",
                              "poison", "kill-cm", "kill-je", "kill-kv-tier", "kill-gateway",
                              "disk-full", "corrupt-disk", "dualpath-de-fail", "kill-node",
                              "scale-across", "kill-head"}
    assert get_scenario("kill-je").node_process and get_scenario("poison").every_te_of_type
    assert get_scenario("hang-worker").fault == "SIGSTOP"
    assert get_scenario("hang-worker", "stall").name == "stall-worker"
    assert get_scenario("hang-worker", "sigstop").name == "hang-worker"
    assert get_scenario("hang-worker-stall").name == "stall-worker"
    with pytest.raises(ValueError, match="unknown scenario"):
        get_scenario("kill-everything")
    with pytest.raises(ValueError, match="hang-worker only"):
        get_scenario("kill-worker", "stall")


def test_targets_and_deadlines():
    types = {"te0": "colocated", "te1": "colocated", "te12": "prefill", "te3": "prefill",
             "te4": "decode"}
    assert target_te(get_scenario("kill-worker"), types) == "te0"
    assert target_te(get_scenario("kv-transfer-fail"), types) == "te3"
    with pytest.raises(LookupError, match="no prefill TE"):
        target_te(get_scenario("kv-transfer-fail"), {"te0": "colocated"})
    sup = SimpleNamespace(heartbeat_deadline_s=1.5, progress_deadline_s=7.0)
    assert deadline_of(get_scenario("kill-master"), sup) == 1.5
    assert deadline_of(get_scenario("hang-worker"), sup) == 1.5
    assert deadline_of(get_scenario("stall-worker"), sup) == 7.0
    assert deadline_of(get_scenario("slow-worker"), sup) == 7.0
    assert deadline_of(get_scenario("drop-cache"), sup) is None
    assert deadline_of(get_scenario("kill-worker"), None) == 3.0  # the supervisor defaults
    assert hook_path("/x", "te0/worker0", "stall") == Path("/x/te0.worker0.stall")
    assert target_tes(get_scenario("drop-cache"), "te1", types) == ["te1", "te0"]
    assert target_tes(get_scenario("drop-cache"), "te3", types) == ["te3", "te12"]
    assert target_tes(get_scenario("kill-worker"), "te0", types) == ["te0"]


def _line(t: float, component: str, event: str, pid=None, **details) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    return json.dumps({"time": stamp, "node": "n0", "component": component, "pid": pid,
                       "event": event, "details": details}) + "\n"


def test_health_events_parsing(tmp_path):
    t0 = 1_700_000_000.0
    (tmp_path / "health.jsonl.1").write_text(
        _line(t0, "te0", "started", 10, te_type="colocated")
        + _line(t0 + 0.1, "te0/worker0", "started", 11)
        + _line(t0 + 0.1, "te2", "ready", 20, te_type="prefill"))
    (tmp_path / "health.jsonl").write_text(
        "not json\n"
        + _line(t0 + 5, "te1/worker0", "heartbeat_missed", 31)
        + _line(t0 + 6, "te0/worker0", "crashed", 11, exit_code=-9)
        + _line(t0 + 6.5, "te0", "restarting", 10)
        + _line(t0 + 9, "te0/worker0", "started", 12)
        + _line(t0 + 10, "te0", "recovered", 13)
        + '{"time": "2023-11-14T22:13:30.000Z", "torn')
    events = HealthEvents(tmp_path)
    assert len(events.events()) == 8
    assert events.latest_pid("te0/worker0") == (12, pytest.approx(t0 + 9, abs=0.002))
    assert events.latest_pid("te0/master") is None
    first = events.first(t0 + 1, DETECT_EVENTS)
    assert first["component"] == "te1/worker0"
    first = events.first(t0 + 1, DETECT_EVENTS, te="te0")
    assert (first["event"], first["pid"]) == ("crashed", 11)
    assert events.first(t0 + 6.1, DETECT_EVENTS, te="te0") is None
    assert events.first(t0 + 1, {"recovered"}, te="te0")["t"] == pytest.approx(t0 + 10, abs=0.002)
    assert events.te_types() == {"te0": "colocated", "te2": "prefill"}
    assert HealthEvents(tmp_path / "missing").events() == []


@pytest.fixture
def sleeper():
    """A throwaway process of this test, standing in for a TE component."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(5)


def _log_started(log_dir: Path, component: str, pid: int) -> HealthEvents:
    with HealthLog(log_dir / "health.jsonl", "n0") as hl:
        hl.write(component, "started", pid=pid)
    return HealthEvents(log_dir)


def test_kill_injection_hits_the_logged_pid(tmp_path, sleeper):
    events = _log_started(tmp_path, "te0/worker0", sleeper.pid)
    inj = Injection(get_scenario("kill-worker"), "te0", ["te0/worker0"])
    at = inj.inject(events, None)
    assert inj.pid == sleeper.pid and abs(at - time.time()) < 5
    assert sleeper.wait(5) == -signal.SIGKILL


def test_sigstop_injection_never_leaves_a_stopped_process(tmp_path, sleeper):
    events = _log_started(tmp_path, "te0/worker0", sleeper.pid)
    inj = Injection(get_scenario("hang-worker"), "te0", ["te0/worker0"])
    inj.inject(events, None)
    deadline = time.monotonic() + 5
    while psutil.Process(sleeper.pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    inj.cleanup()
    assert sleeper.wait(5) == -signal.SIGKILL
    assert inj.notes and "SIGKILL" in inj.notes[0]


def test_sigstop_cleanup_leaves_a_running_process_alone(tmp_path, sleeper):
    events = _log_started(tmp_path, "te0/worker0", sleeper.pid)
    inj = Injection(get_scenario("hang-worker"), "te0", ["te0/worker0"])
    inj.inject(events, None)
    os.kill(sleeper.pid, signal.SIGCONT)  # e.g. someone resumed it
    time.sleep(0.1)
    inj.cleanup()
    assert sleeper.poll() is None and not inj.notes


def test_pid_checks(tmp_path, sleeper):
    with HealthLog(tmp_path / "health.jsonl", "n0") as hl:
        hl.write("te0/master", "started", pid=sleeper.pid)
        hl.write("te0/tokenizer", "started", pid=None)
    events = HealthEvents(tmp_path)
    assert current_pid(events, "te0/master") == sleeper.pid
    with pytest.raises(LookupError, match="no started"):
        current_pid(events, "te0/tokenizer")
    old = tmp_path / "old"
    old.mkdir()
    (old / "health.jsonl").write_text(_line(time.time() - 3600, "te0/master", "started",
                                            sleeper.pid))
    with pytest.raises(LookupError, match="reused"):
        current_pid(HealthEvents(old), "te0/master")
    sleeper.kill()
    sleeper.wait(5)
    with pytest.raises(LookupError, match="gone"):
        current_pid(events, "te0/master")


def test_hook_injection_writes_and_removes_its_file(tmp_path):
    inj = Injection(get_scenario("slow-worker"), "te0", ["te0/worker0"])
    inj.inject(None, tmp_path)
    assert (tmp_path / "te0.worker0.slow").read_text() == "0.05"
    assert not inj.hook_consumed()
    inj.cleanup()
    assert list(tmp_path.iterdir()) == [] and inj.lifted_at is not None
    inj = Injection(get_scenario("kv-transfer-fail"), "te2", ["te2/worker0"])
    inj.inject(None, tmp_path)
    (tmp_path / "te2.worker0.kv-fail").unlink()  # what the engine does once it used it
    assert inj.hook_consumed()
    inj.cleanup()
    inj = Injection(get_scenario("drop-cache"), "te0", ["te0/master", "te1/master"])
    inj.inject(None, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["te0.master.drop-cache",
                                                          "te1.master.drop-cache"]
    (tmp_path / "te0.master.drop-cache").unlink()
    assert not inj.hook_consumed()  # one of two masters used it
    (tmp_path / "te1.master.drop-cache").unlink()
    assert inj.hook_consumed()
    with pytest.raises(RuntimeError, match="drill dir"):
        Injection(get_scenario("drop-cache"), "te0", ["te0/master"]).inject(None, None)
    with pytest.raises(RuntimeError, match="log-dir"):
        Injection(get_scenario("kill-master"), "te0", ["te0/master"]).inject(None, tmp_path)


def test_corrupt_injection_flips_a_byte_of_every_block_file_and_keeps_its_size(tmp_path):
    disk = tmp_path / "disk"
    files = [disk / "m-1" / "ab" / f"{i:016x}.kv" for i in range(3)]
    for i, f in enumerate(files):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(bytes([i]) * 100)
    (disk / "m-1" / "notes.txt").write_bytes(b"not a block")
    inj = Injection(get_scenario("corrupt-disk"), "kv-cache", ["kv-cache"], disk_dir=str(disk))
    at = inj.inject(None, None)
    assert at is not None and sorted(inj.corrupted) == sorted(files)
    for i, f in enumerate(files):
        data = f.read_bytes()
        assert len(data) == 100 and data[:-1] == bytes([i]) * 99 and data[-1] == i ^ 0x55
    assert (disk / "m-1" / "notes.txt").read_bytes() == b"not a block"
    assert inj.notes == ["3 block files corrupted"]
    with pytest.raises(RuntimeError, match="no disk tier"):
        Injection(get_scenario("corrupt-disk"), "kv-cache", ["kv-cache"]).inject(None, None)


def test_an_event_proof_pokes_once_after_its_first_part_and_fails_without_the_event(tmp_path):
    """disk-full: once the hook fired, one fresh prompt (poke) makes a block
    write fail; proven only by the tier service's cache_tier_disabled."""
    t0 = time.time()
    log = tmp_path / "health.jsonl"
    log.write_text(_line(t0 - 1, "kv-cache", "cache_tier_disabled", 9, tier="disk"))  # old
    events = HealthEvents(tmp_path)
    fired = HookFired(events, ["kv-cache"], "disk-full", t0, bound_s=5.0)
    pokes = []
    proof = Proofs([fired, Logged(events, "cache_tier_disabled", "kv-cache", t0, after=fired,
                                  poke=lambda: pokes.append(1))])
    proof.poll(t0 + 0.1)
    assert pokes == [] and not proof.is_settled  # the hook has not fired: no poke yet
    with log.open("a") as f:
        f.write(_line(t0 + 0.2, "kv-cache", "fault_injected", 9, fault="disk-full", value=""))
    proof.poll(t0 + 0.3)
    assert pokes == [1] and not proof.is_settled
    proof.poll(t0 + 0.4)
    assert pokes == [1]  # once
    with log.open("a") as f:
        f.write(_line(t0 + 0.5, "te0/master", "cache_tier_disabled", 7, tier="disk")
                + _line(t0 + 0.6, "kv-cache", "cache_tier_disabled", 9, tier="disk"))
    proof.poll(t0 + 0.7)
    assert proof.is_proven and proof.evidence[-1].startswith("kv-cache cache_tier_disabled +0.")
    never = Logged(events, "cache_block_corrupt", None, t0)
    never.finish([])
    assert not never.is_proven and "no cache_block_corrupt event" in never.failure
    empty = Logged(events, "cache_block_corrupt", None, t0, failure="no block file to corrupt")
    assert empty.is_settled and not empty.is_proven


def test_long_prompts_pass_the_pd_threshold(tiny_model):
    count = drill_prompts.token_counter(str(tiny_model))
    assert count is not None
    prompts = drill_prompts.make_prompts(100, count)
    lengths = [count(p) for p in prompts]
    assert sum(n > 100 for n in lengths) == 3 and sum(n < 20 for n in lengths) == 3
    assert all(len(p) > 600 for p in drill_prompts.make_prompts(100)[1::2])  # no tokenizer
    probe = drill_prompts.make_probe_prompt(100, count)
    assert 64 <= count(probe) < 100  # 4+ full blocks of 16, yet colocated
    assert drill_prompts.make_probe_prompt(100, count) != probe  # a fresh prefix each time


# --- proof: a drill whose fault did not happen fails ------------------------------------------

def test_hook_proof_needs_the_targets_own_fault_injected_event(tmp_path):
    t0 = time.time()
    (tmp_path / "health.jsonl").write_text(
        _line(t0 - 5, "te0/master", "fault_injected", 10, fault="drop-cache", value="")  # old
        + _line(t0 + 0.5, "te0/master", "fault_injected", 10, fault="drop-cache", value="")
        + _line(t0 + 0.6, "te1/master", "fault_injected", 11, fault="stall", value=""))
    events = HealthEvents(tmp_path)
    both = HookFired(events, ["te0/master", "te1/master"], "drop-cache", t0, bound_s=2.0)
    both.poll(t0 + 1)
    assert not both.is_settled and both.failure is None  # te1's drop not seen yet
    both.poll(t0 + 3)
    assert both.is_settled and not both.is_proven
    assert "te1/master" in both.failure and "te0/master" not in both.failure
    one = HookFired(events, ["te0/master"], "drop-cache", t0, bound_s=2.0)
    one.poll(t0 + 1)
    assert one.is_proven  # +0.499 or +0.500 s: the log keeps milliseconds
    assert one.evidence[0].startswith("te0/master fault_injected drop-cache +0.")
    stale = HookFired(events, ["te0/master"], "drop-cache", t0 + 1, bound_s=2.0)
    stale.finish([])
    assert not stale.is_proven and "never fired" in stale.failure


def test_signal_proof_needs_a_detection_of_that_pid(tmp_path):
    t0 = time.time()
    (tmp_path / "health.jsonl").write_text(
        _line(t0 + 0.1, "te1/worker0", "crashed", 77)      # another process
        + _line(t0 + 0.2, "te0", "killed", 50)             # the supervisor's act, no detection
        + _line(t0 + 0.3, "te0/worker0", "heartbeat_missed", 42))
    events = HealthEvents(tmp_path)
    proof = SignalDetected(events, "te0", "te0/worker0", 42, 50, t0)
    proof.poll(t0 + 1)
    assert proof.is_proven and "heartbeat_missed pid 42" in proof.evidence[-1]
    other = SignalDetected(events, "te0", "te0/worker0", 43, 50, t0)
    other.poll(t0 + 1)
    assert not other.is_settled
    other.finish([])
    assert not other.is_proven and "pid 43" in other.failure


def test_signal_proof_accepts_the_host_crash_once_the_pid_is_gone(tmp_path, sleeper):
    t0 = time.time()
    (tmp_path / "health.jsonl").write_text(_line(t0 + 0.1, "te0", "crashed", 50))
    events = HealthEvents(tmp_path)
    proof = SignalDetected(events, "te0", "te0/master", sleeper.pid, 50, t0)
    proof.poll(t0 + 1)
    assert not proof.is_settled  # the master still runs: the host died of something else
    sleeper.kill()
    sleeper.wait(5)
    proof.poll(t0 + 2)
    assert proof.is_proven and "te0 crashed pid 50" in proof.evidence[-1]


def test_signal_proof_accepts_a_sibling_crash_of_the_same_te_once_the_pid_is_gone(
        tmp_path, sleeper):
    """Killing te0's tokenizer makes its host stop the TE: te0/master's crash
    may be logged first. Another TE's crash never counts."""
    t0 = time.time()
    (tmp_path / "health.jsonl").write_text(_line(t0 + 0.1, "te1/master", "crashed", 60)
                                           + _line(t0 + 0.2, "te0/master", "crashed", 61))
    events = HealthEvents(tmp_path)
    proof = SignalDetected(events, "te0", "te0/tokenizer", sleeper.pid, 50, t0)
    proof.poll(t0 + 1)
    assert not proof.is_settled  # the tokenizer still runs
    sleeper.kill()
    sleeper.wait(5)
    proof.poll(t0 + 2)
    assert proof.is_proven and "te0/master crashed pid 61" in proof.evidence[-1]
    other = SignalDetected(HealthEvents(tmp_path), "te2", "te2/tokenizer", sleeper.pid, 70, t0)
    other.poll(t0 + 2)
    assert not other.is_settled


def _probe(cached: int | None, status: str = COMPLETED) -> RequestRecord:
    usage = None if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
    return RequestRecord(id=-1, prompt_index=-1, max_tokens=1, start=0.0, status=status,
                         usage=usage)


def test_cache_proof_needs_a_hit_before_and_a_miss_right_after(tmp_path):
    t0 = time.time()
    (tmp_path / "health.jsonl").write_text(
        _line(t0 + 0.1, "te0/master", "fault_injected", 10, fault="drop-cache", value=""))
    events = HealthEvents(tmp_path)

    def check(before, after):
        fired = HookFired(events, ["te0/master"], "drop-cache", t0, bound_s=2.0)
        proof = Proofs([fired, CacheMissed(fired, lambda: after, before)])
        proof.poll(t0 + 1)
        return proof

    assert check(48, _probe(0)).is_proven
    assert check(48, _probe(16)).is_proven  # a shared prefix block may stay
    kept = check(48, _probe(48))
    assert kept.is_settled and not kept.is_proven and "not dropped" in kept.failure
    assert "not cached before" in check(0, _probe(0)).failure
    assert "did not complete" in check(48, _probe(None, "failed")).failure


def test_transfer_proof_needs_a_resumed_request_that_completed(tmp_path):
    t0 = time.time()
    (tmp_path / "health.jsonl").write_text(_line(
        t0 + 0.5, "job-executor", "request_migrated", 9, request_id="cmpl-abc-0", te_id="te3",
        attempt=1, prompt_tokens=140))
    events = HealthEvents(tmp_path)
    done = RequestRecord(id=3, prompt_index=1, max_tokens=4, start=t0, status=COMPLETED,
                         response_id="cmpl-abc")
    proof = TransferResumed(events, t0)
    proof.poll(t0 + 1)
    assert proof.is_settled and not proof.is_proven  # proven only once the load ended
    proof.finish([done])
    assert proof.is_proven and "cmpl-abc-0 resumed on te3" in proof.evidence[0]
    failed = TransferResumed(events, t0)
    failed.finish([RequestRecord(id=3, prompt_index=1, max_tokens=4, start=t0, status="failed",
                                 response_id="cmpl-abc")])
    assert not failed.is_proven and "did not complete" in failed.failure
    nothing = TransferResumed(events, t0 + 1)
    nothing.finish([done])
    assert not nothing.is_proven and "no request_migrated" in nothing.failure


def test_a_drill_whose_fault_never_fired_fails(tmp_path):
    """The fault file goes to a folder no process reads: the streams are all
    fine, and the drill still fails, quickly, saying why."""
    from tests.drill.test_load import MODEL, sse_server

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "health.jsonl").write_text("")
    (tmp_path / "drill").mkdir()
    with sse_server({}) as (url, _):
        t0 = time.monotonic()
        report = run_drill(get_scenario("slow-worker"), url=url, model=MODEL,
                           log_dir=tmp_path / "logs", drill_dir=tmp_path / "drill",
                           duration_s=0.5, warmup_s=0.2, settle_s=0.1, prompts=["a", "b"],
                           max_tokens=3, fire_bound_s=1.0)
        took = time.monotonic() - t0
    assert report.completed > 0 and report.lost == 0 and report.bad_streams == 0
    assert report.fault_proven is False and not report.ok
    assert "never fired" in report.proof and "te0/worker0" in report.proof
    assert "fault not proven" in report.to_text()
    assert took < 10  # the bound on firing, not the recovery bound (60 s), ended it
    assert not list((tmp_path / "drill").iterdir())  # the hook file was taken back


def _conf_without_supervisor(tmp_path: Path) -> Path:
    """conf/drill.toml minus [supervisor], for a load_node_config without it."""
    (tmp_path / "conf").mkdir()
    text = DRILL_CONF.read_text().replace('"models/tiny"', json.dumps(str(ROOT / "models/tiny")))
    lines, skip = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skip = line.strip() == "[supervisor]"
        if not skip:
            lines.append(line)
    path = tmp_path / "conf" / "drill.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("tokens,proven,code", [([1, 2, 3], True, 0), ([1, 9, 3], True, 1),
                                                ([1, 2, 3], False, 1)])
def test_cli_exit_code_and_json(tmp_path, monkeypatch, tokens, proven, code):
    seen = {}

    def fake_run_drill(scenario, **kwargs):
        seen.update(kwargs, scenario=scenario.name)
        record = RequestRecord(id=0, prompt_index=0, max_tokens=3, start=1.0, end=2.0,
                               token_ids=tokens, finish_reason="length", status=COMPLETED)
        return build_report(scenario.name, [record], {0: [1, 2, 3]}, 4.0, 1.0, 2.0, 3.0,
                            fault_proven=proven, proof="evidence" if proven else "never fired")

    monkeypatch.setattr(drill_main, "run_drill", fake_run_drill)
    monkeypatch.setattr(drill_main.signal, "signal", lambda *a: None)  # leave pytest's alone
    out = tmp_path / "r.json"
    conf = _conf_without_supervisor(tmp_path)
    result = CliRunner().invoke(drill_main.main, [
        "hang-worker", "--mode", "stall", "--url", "http://127.0.0.1:9/", "--conf", str(conf),
        "--log-dir", str(tmp_path), "--drill-dir", str(tmp_path), "--json", str(out),
        "--model", "m", "--duration", "3"])
    assert result.exit_code == code, result.output
    report = json.loads(out.read_text())
    assert tuple(report) == KEYS and report["scenario"] == "stall-worker"
    assert report["detect_s"] == 1.0 and report["recover_s"] == 2.0
    assert seen["url"] == "http://127.0.0.1:9" and seen["model"] == "m"
    assert seen["duration_s"] == 3.0 and seen["log_dir"] == str(tmp_path)
    assert ("PASS" if code == 0 else "FAIL") in result.output
    assert report["fault_proven"] is proven
    if not proven:
        assert "fault not proven: never fired" in result.output


def test_cli_rejects_unknown_scenario():
    result = CliRunner().invoke(drill_main.main, ["kill-everything"])
    assert result.exit_code == 2 and "unknown scenario" in result.output


# --- the real drills: one node, every scenario in turn ---------------------------------------

@pytest.fixture(scope="module")
def drill_node(tiny_model):
    from msgspec.structs import replace

    from deepserve.supervisor.node import Node
    from deepserve.supervisor.node_config import load_node_config
    config = load_node_config(DRILL_CONF, overrides={"port": free_port(),
                                                      "model": str(tiny_model)})
    config = replace(config, supervisor=replace(config.supervisor, drill=True))
    node = Node(config)
    node.start()
    yield node
    node.stop()


# cheap ones first; restarting ones alternate te0 / te1 so no TE's restart budget is strained
REAL_DRILLS = [("slow-worker", None), ("drop-cache", None), ("kv-transfer-fail", None),
               ("kill-worker", "te0"), ("hang-worker", "te1"), ("stall-worker", "te0"),
               ("kill-master", "te1"), ("kill-tokenizer", "te0"), ("kill-gateway", None)]


@pytest.mark.slow
@pytest.mark.parametrize("name,te", REAL_DRILLS, ids=[n for n, _ in REAL_DRILLS])
def test_drill(drill_node, name, te):
    scenario = get_scenario(name)
    started = time.monotonic()
    report = run_drill(
        scenario, url=drill_node.url, model=drill_node.config.served_model,
        config=drill_node.config, log_dir=drill_node.log_dir, drill_dir=drill_node.drill_dir,
        duration_s=5, concurrency=3, max_tokens=16, warmup_s=1.5, request_timeout_s=30, te=te,
        echo=print)
    print(report.to_json())
    print(drill_main._describe(report))
    # first the proof that the fault happened, then the recovery
    assert report.fault_proven is True, report.proof
    evidence = report.details["evidence"]
    if scenario.is_signal:
        pid = report.details["pid"]
        assert evidence[0] == f"signal delivered to {report.details['component']} pid {pid}"
        assert any(e.split()[1] in ("crashed", "hung", "heartbeat_missed") for e in evidence[1:])
    else:
        fired = [e for e in evidence if " fault_injected " in e]
        assert {e.split()[0] for e in fired} == set(report.details["components"]), evidence
    if name == "drop-cache":
        assert report.details["components"] == ["te0/master", "te1/master"]
        assert any(e.startswith("probe cached_tokens") for e in evidence), evidence
    if name == "kv-transfer-fail":
        assert report.details["components"] == ["te2/worker0"]
        assert any(" resumed on " in e and e.endswith("completed") for e in evidence), evidence
    assert report.sent > 0 and report.lost == 0 and report.bad_streams == 0, report.details
    assert report.completed > 0
    assert not list(Path(drill_node.drill_dir).glob("te*.*")), "a fault file was left behind"
    sup = drill_node.config.supervisor
    if scenario.restarts:
        detect_bound = 2 * report.deadline_s + 2
        assert report.detect_s is not None and 0 <= report.detect_s <= detect_bound, report
        assert report.recover_s is not None, report.details
        bound = detect_bound + sup.kill_grace_s + RESTART_DELAY_S + TE_START_S
        assert report.recover_s <= bound, report
    else:
        assert report.recover_s is not None, report.details  # a request completed after it
        if name == "slow-worker":
            assert report.detect_s is None, report.details  # slow is not hung
        if name in ("drop-cache", "kv-transfer-fail"):
            assert report.details["hook_consumed"], "the engine never used the fault file"
    assert time.monotonic() - started < 120


def _control_plane_and_poison(node) -> list[str]:
    """kill-cm, kill-je, then poison on one node (issue 11); the reports' lines."""
    lines = []
    for name in ("kill-cm", "kill-je", "poison"):
        report = run_drill(
            get_scenario(name), url=node.url, model=node.config.served_model,
            config=node.config, log_dir=node.log_dir, drill_dir=node.drill_dir,
            duration_s=3, concurrency=3, max_tokens=16, warmup_s=1.0, request_timeout_s=60,
            echo=print)
        print(report.to_json())
        lines.append(f"{name}: {drill_main._describe(report).splitlines()[0]}")
        assert report.fault_proven is True, report.proof  # the fault happened, first
        # a control-plane restart refuses nothing and loses nothing; neither does poison
        assert report.sent > 0 and report.lost == 0 and report.bad_streams == 0, report.details
        assert report.failed == 0, report.details
        assert report.recover_s is not None, report.details
        if name == "poison":
            poison = report.details["poison"]
            assert poison["poison"]["error_code"] == "request_crashed_engine", poison
            assert poison["load_503"] == 0, poison  # availability: healthy requests served
            # resume-once costs two restarts, both of the TE it first crashed
            # ([router] isolate_suspects: back where it crashed; suspects.py)
            assert poison["num_tes_restarted"] == 1 and poison["te_restarts"] <= 2, poison
        else:
            assert report.details["restarts"] == [get_scenario(name).part], report.details
        if name == "kill-cm":  # the new CM listed every TE at once: no task was failed over
            assert not [line for line in report.details["timeline"]
                        if " request_migrated " in line], report.details["timeline"]
    assert not list(Path(node.drill_dir).glob("te*.*")), "a fault file was left behind"
    return lines


@pytest.mark.slow
def test_control_plane_and_poison_drills(drill_node):
    """bin/deepserve-drill kill-cm / kill-je / poison: restarts, lost = 0,
    bad_streams = 0, nothing refused; the request of death quarantined."""
    print("\n".join(_control_plane_and_poison(drill_node)))

