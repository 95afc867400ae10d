"""The health log (JSON lines, rotation, threads) and bin/deepserve-health."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

import deepserve
from deepserve.supervisor.health_cli import format_event, main
from deepserve.supervisor.health_log import EVENTS, KEYS, SEVERITY, HealthLog, read_events


def _raw_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_lines_are_json_with_exact_keys(tmp_path: Path) -> None:
    path = tmp_path / "health.jsonl"
    with HealthLog(path, node="n0") as log:
        log.write("te0", "started", pid=42)
        log.write("te0", "crashed", pid=42, exit_code=-9, signal="SIGKILL")
        log.write("gateway", "ready")
    records = [json.loads(line) for line in _raw_lines(path)]  # the jq check
    assert [tuple(r) for r in records] == [KEYS] * 3
    assert [r["event"] for r in records] == ["started", "crashed", "ready"]
    assert records[1]["details"] == {"exit_code": -9, "signal": "SIGKILL"}
    assert records[2]["pid"] is None and records[0]["node"] == "n0"
    stamp = records[0]["time"]
    assert stamp.endswith("Z") and len(stamp.split(".")[1]) == 4  # mmm + Z
    datetime.fromisoformat(stamp)
    assert list(read_events(path)) == records


def test_closed_event_list_and_severity() -> None:
    assert isinstance(EVENTS, frozenset) and set(SEVERITY) == EVENTS
    assert set(SEVERITY.values()) == {"debug", "info", "warning", "error"}


def _emitted_event_names() -> set[str]:
    """Every literal event name src/ hands to the health log: health.write /
    _log (2nd argument), .event / .events (1st argument)."""
    import ast

    names = set()
    for path in Path(deepserve.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = func.value if isinstance(func, ast.Attribute) else None
            is_health = isinstance(owner, ast.Attribute) and owner.attr == "health" or \
                isinstance(owner, ast.Name) and owner.id == "health"
            index = {"_log": 1, "event": 0, "_event": 0, "events": 0}.get(name)
            if name == "write" and is_health:
                index = 1
            if index is not None and len(node.args) > index and \
                    isinstance(node.args[index], ast.Constant):
                names.add(node.args[index].value)
    return names


def test_nothing_emits_an_event_outside_the_list() -> None:
    from deepserve.supervisor.watchdog import FAULT_KINDS

    emitted = _emitted_event_names()
    # the scan sees the supervisor, the node, the job executor and the actor
    assert {"restarting", "killed", "evicted", "request_migrated", "fault_injected",
            "cache_tier_enabled"} <= emitted
    assert emitted <= EVENTS, sorted(emitted - EVENTS)
    assert set(FAULT_KINDS) <= EVENTS  # the watchdog's kinds are logged as they are


def test_unknown_event_raises(tmp_path: Path) -> None:
    with HealthLog(tmp_path / "h.jsonl", node="n0") as log:
        with pytest.raises(ValueError, match="exploded"):
            log.write("te0", "exploded")
    assert (tmp_path / "h.jsonl").read_text() == ""


def test_read_events_skips_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with HealthLog(path, node="n0") as log:
        log.write("te0", "started", pid=1)
    with open(path, "a") as f:
        f.write('{"time": "2025-01-01T00:00:00.000Z", "ev')
    assert [r["event"] for r in read_events(path)] == ["started"]


def test_rotation_from_threads_keeps_lines_whole(tmp_path: Path) -> None:
    path = tmp_path / "health.jsonl"
    log = HealthLog(path, node="n0", max_bytes=4096, backups=3)
    num_threads, per_thread = 4, 100

    def writer(n: int) -> None:
        for i in range(per_thread):
            log.write(f"te{n}", "heartbeat_missed", pid=n, seq=i)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["health.jsonl", "health.jsonl.1", "health.jsonl.2", "health.jsonl.3"]
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert max(sizes) <= 4096
    # Everything still on disk parses; nothing written was lost or torn.
    kept = [json.loads(line) for name in files for line in _raw_lines(tmp_path / name)]
    assert all(tuple(r) == KEYS for r in kept)
    # Old files were dropped whole, so count what the newest files hold: each
    # (component, seq) at most once, and the newest file ends with the last writes.
    seen = {(r["component"], r["details"]["seq"]) for r in kept}
    assert len(seen) == len(kept)
    total = num_threads * per_thread
    line_len = len(_raw_lines(path)[0]) + 1
    assert len(kept) >= min(total, 3 * (4096 // line_len))


def test_rotation_count_matches_when_nothing_dropped(tmp_path: Path) -> None:
    path = tmp_path / "health.jsonl"
    log = HealthLog(path, node="n0", max_bytes=8192, backups=50)

    def writer(n: int) -> None:
        for i in range(200):
            log.write(f"te{n}", "heartbeat_missed", pid=n, seq=i)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    names = [p for p in tmp_path.iterdir()]
    assert 2 < len(names) <= 51
    records = [json.loads(line) for p in names for line in _raw_lines(p)]
    assert len(records) == 800
    assert {(r["component"], r["details"]["seq"]) for r in records} == {
        (f"te{n}", i) for n in range(4) for i in range(200)}


@pytest.fixture
def sample_log(tmp_path: Path) -> Path:
    path = tmp_path / "health.jsonl"
    with HealthLog(path, node="n0") as log:
        log.write("te0", "started", pid=10)
        log.write("te1", "crashed", pid=11, exit_code=-9, reason="out of memory")
        log.write("gateway", "ready", pid=12)
        log.write("te1", "restarting", pid=11, attempt=1)
    return path


def test_cli_formats_lines(sample_log: Path) -> None:
    result = CliRunner().invoke(main, [str(sample_log)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 4
    clock, who, event, details = lines[1].split("  ")
    assert len(clock) == 12 and clock[2] == ":" and clock[8] == "."
    assert (who, event) == ("te1[11]", "crashed")
    assert details == 'exit_code=-9 reason="out of memory"'
    assert "\x1b[" not in result.output  # not a TTY: no colour


def test_cli_filters_by_component_and_event(sample_log: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(main, [str(sample_log), "--component", "te1", "--no-color"]).output
    assert [line.split("  ")[2] for line in out.splitlines()] == ["crashed", "restarting"]
    out = runner.invoke(main, [str(sample_log), "-c", "te0", "-c", "gateway"]).output
    assert [line.split("  ")[1] for line in out.splitlines()] == ["te0[10]", "gateway[12]"]
    out = runner.invoke(main, [str(sample_log), "--event", "ready", "--event", "started"]).output
    assert [line.split("  ")[2] for line in out.splitlines()] == ["started", "ready"]
    out = runner.invoke(main, [str(sample_log), "-c", "te1", "-e", "restarting"]).output
    assert len(out.splitlines()) == 1 and "attempt=1" in out
    assert runner.invoke(main, [str(sample_log), "-e", "bogus"]).exit_code == 2


def test_cli_env_default_and_missing_file(sample_log: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, [], env={"DEEPSERVE_HEALTH_LOG": str(sample_log)})
    assert result.exit_code == 0 and len(result.output.splitlines()) == 4
    result = runner.invoke(main, [str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 1 and "no health log" in result.output


def test_cli_skips_invalid_json_with_warning(sample_log: Path) -> None:
    with open(sample_log, "a") as f:
        f.write("not json at all\n[1, 2]\n")
        f.write(json.dumps({"time": "x", "component": "te9", "event": "ready",
                            "pid": 1, "details": {}}) + "\n")
    result = CliRunner().invoke(main, [str(sample_log), "--no-color"])
    assert result.exit_code == 0
    assert len(result.stdout.splitlines()) == 5
    assert result.stderr.count("skipping invalid line") == 2


def test_color_by_severity() -> None:
    record = {"time": "2025-01-01T12:34:56.789Z", "component": "te0", "pid": 1,
              "event": "crashed", "details": {}}
    assert format_event(record, color=True) == "\x1b[31m12:34:56.789  te0[1]  crashed\x1b[0m"
    assert format_event({**record, "event": "heartbeat_missed"}, True).startswith("\x1b[33m")
    assert format_event(record) == "12:34:56.789  te0[1]  crashed"


def _start_follow(path: Path) -> tuple[subprocess.Popen, queue.Queue]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepserve.supervisor.health_cli", str(path), "--follow"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def test_follow_picks_up_new_lines_and_survives_rotation(tmp_path: Path) -> None:
    path = tmp_path / "health.jsonl"
    log = HealthLog(path, node="n0", max_bytes=400, backups=2)
    log.write("te0", "started", pid=1)
    proc, lines = _start_follow(path)
    try:
        assert "started" in lines.get(timeout=10)
        log.write("te0", "ready", pid=1)
        got = lines.get(timeout=5)
        assert "ready" in got and "\x1b[" not in got  # a pipe: no colour
        # Lines are ~100-120 bytes: the second of these writes rotates the file
        # exactly once (two rotations inside one 0.2 s poll would lose lines,
        # as with tail -F).
        for i in range(4):
            log.write("te0", "heartbeat_missed", pid=1, seq=i)
        got = [lines.get(timeout=5) for _ in range(4)]
        assert [g.rsplit("=", 1)[1] for g in got] == ["0", "1", "2", "3"]
        assert Path(f"{path}.1").exists()
    finally:
        log.close()
        proc.terminate()
        proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode is not None


def test_follow_ctrl_c_exits_zero(tmp_path: Path) -> None:
    import signal
    path = tmp_path / "health.jsonl"
    with HealthLog(path, node="n0") as log:
        log.write("te0", "started", pid=1)
    proc, lines = _start_follow(path)
    try:
        lines.get(timeout=10)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
    assert not os.path.exists(f"{path}.1")
