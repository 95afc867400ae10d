"""tools/trace_request.py's report, on made-up profiler dumps (no node): it
prints the hops of docs/architecture.md (HOPS of tools/architecture.py), each
with its message type and files and where it was first seen."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


trace = _load("trace_request")
HOPS = trace.HOPS


def test_each_hop_line_names_its_message_and_files():
    for n, hop in enumerate(HOPS, 1):
        line = trace.hop_line(n, hop)
        assert line.startswith(f"{n:2d}. {hop.message} ")
        assert all(f in line for f in (hop.sender_file, hop.receiver_file, hop.transport) if f)


def test_the_hops_are_the_documented_request_path():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert [h.message for h in HOPS] == ["POST /v1/chat/completions", "SubmitRequest",
                                         "SubmitRequest", "AddRequest", "StepBatch", "StepDone",
                                         "StepTokens", "RequestDelta", "SSE chunk"]
    for n, hop in enumerate(HOPS, 1):
        assert f"| {n} | {hop.message} |" in doc


def test_process_names():
    assert trace._process_name(["-c"], "deepserve-master") == "master"
    assert trace._process_name(["x", "--conf", "n.json", "--role", "gateway"]) == "gateway"
    assert trace._process_name(["x", "-m", "deepserve.supervisor"], "MainProcess") == "supervisor"


def test_a_hop_is_seen_at_its_first_call_inside_the_request(tmp_path):
    t0 = 1000.0
    je = f"deepserve/{HOPS[1].seen}"
    master = f"deepserve/{HOPS[3].seen}"
    dumps = {
        "101.json": {"argv": ["x", "--role", "job-executor"], "calls": {
            je: [t0 - 5, t0 + 0.004, t0 + 0.009]}},  # before the request: not counted
        "102.json": {"argv": ["-c"], "name": "deepserve-master", "calls": {
            master: [t0 + 0.012], "deepserve/engine/te/master.py:Master.step": [t0 - 1, t0 + 0.01]}},
    }
    for name, data in dumps.items():
        (tmp_path / name).write_text(json.dumps(data))
    lines = trace.hop_report(trace._load(tmp_path), (t0, t0 + 1))
    assert len(lines) == len(HOPS)
    assert "4.0 ms  job-executor[101]" in lines[1] and "SubmitRequest" in lines[1]
    assert "12.0 ms  master[102]" in lines[3] and "AddRequest" in lines[3]
    assert lines[0].lstrip().startswith("not seen") and "gateway/http/app.py" in lines[0]


def test_the_report_prints_hops_then_files(tmp_path, capsys):
    t0 = 1000.0
    (tmp_path / "7.json").write_text(json.dumps({"argv": ["x", "--role", "gateway"], "calls": {
        f"deepserve/{HOPS[0].seen}": [t0 + 0.001]}}))
    trace._report(tmp_path, (t0 - 3, t0 - 0.1), (t0, t0 + 0.05))
    out = capsys.readouterr().out
    assert out.index("hops (docs/architecture.md)") < out.index("files in first-call order")
    assert "1.0 ms  gateway[7]" in out and "deepserve/gateway/http/app.py" in out
