"""build_report / DrillReport on hand-made records."""

from __future__ import annotations

import json

import pytest

from deepserve.drill.report import KEYS, DrillReport, bad_reason, build_report
from deepserve.drill.stream import COMPLETED, FAILED, LOST, RequestRecord

REF = {0: [5, 6, 7, 8], 1: [9, 10]}  # prompt 1 stops early (its reference ends at 2 tokens)


def rec(i: int, status: str, ids: list[int], prompt: int = 0, max_tokens: int = 4,
        usage: dict | None = None) -> RequestRecord:
    return RequestRecord(id=i, prompt_index=prompt, max_tokens=max_tokens, start=100.0 + i,
                         first_token=100.5 + i, end=None if status == LOST else 101.0 + i,
                         token_ids=ids, status=status, usage=usage,
                         finish_reason="length" if status == COMPLETED else None)


@pytest.mark.parametrize("record, bad", [
    (rec(0, COMPLETED, [5, 6, 7, 8]), False),
    (rec(0, COMPLETED, [9, 10], prompt=1), False),            # ends at the reference's stop
    (rec(0, COMPLETED, [5, 6], max_tokens=2), False),         # reference longer than max_tokens
    (rec(0, COMPLETED, [5, 6, 6, 7]), True),                  # repeated token
    (rec(0, COMPLETED, [5, 7, 8]), True),                     # missing token
    (rec(0, COMPLETED, [5, 6, 7]), True),                     # too short
    (rec(0, COMPLETED, [5, 6, 7, 8, 9]), True),               # too long
    (rec(0, COMPLETED, [9, 10, 11], prompt=1), True),         # runs past the reference's stop
    (rec(0, COMPLETED, [5, 6, 7, 8], usage={"completion_tokens": 5}), True),
    (rec(0, COMPLETED, [5, 6, 7, 8], usage={"completion_tokens": 4}), False),
    (rec(0, FAILED, [5, 6]), False),                          # correct partial prefix
    (rec(0, FAILED, []), False),
    (rec(0, FAILED, [5, 5]), True),
    (rec(0, LOST, [5]), False),
    (rec(0, LOST, [6]), True),
])
def test_bad_reason(record, bad):
    assert (bad_reason(record, REF[record.prompt_index]) is not None) == bad


def test_build_report_counts_and_times():
    records = [rec(0, COMPLETED, [5, 6, 7, 8]), rec(1, COMPLETED, [5, 6, 6, 7]),
               rec(2, FAILED, [5]), rec(3, FAILED, [9, 11], prompt=1), rec(4, LOST, [5, 6]),
               rec(5, COMPLETED, [9, 10], prompt=1)]
    records[2].error_type = records[3].error_type = "service_unavailable"
    report = build_report("te_crash", records, REF, deadline_s=30.0, fault_at=1000.0,
                          detected_at=1001.25, recovered_at=1004.5)
    assert report.to_dict() == {"scenario": "te_crash", "sent": 6, "completed": 3, "failed": 2,
                                "lost": 1, "bad_streams": 2, "deadline_s": 30.0,
                                "detect_s": 1.25, "recover_s": 4.5, "fault_proven": None,
                                "proof": None}
    assert set(report.details["bad"]) == {1, 3}
    assert report.details["errors"] == {"service_unavailable": 2}
    assert report.details["lost_ids"] == [4]
    assert not report.ok

    unknown = build_report("x", records[:1], REF, None, None, 5.0, None)
    assert (unknown.detect_s, unknown.recover_s, unknown.deadline_s) == (None, None, None)
    assert unknown.ok


def test_json_has_exactly_the_keys(tmp_path):
    report = build_report("s", [rec(0, COMPLETED, [5, 6, 7, 8])], REF, 10.0, 0.0, 1.0, None)
    assert list(json.loads(report.to_json())) == list(KEYS)
    assert len(KEYS) == 11
    path = tmp_path / "r.json"
    report.write_json(path)
    assert json.loads(path.read_text()) == report.to_dict()
    assert "details" not in path.read_text()


def test_to_text():
    good = DrillReport("s", 3, 3, 0, 0, 0, 10.0, 1.5, None)
    text = good.to_text()
    lines = text.splitlines()
    assert len(lines) == len(KEYS) + 1
    assert lines[0].split() == ["scenario", "s"]
    assert "1.500 s" in text and lines[KEYS.index("recover_s")].split() == ["recover_s", "-"]
    assert lines[-1].split()[:2] == ["verdict", "PASS"]
    bad = DrillReport("s", 3, 1, 0, 1, 1, 10.0, None, None)
    assert bad.to_text().splitlines()[-1].split()[:2] == ["verdict", "FAIL"]
    assert "1 lost" in bad.to_text() and not bad.ok


def test_an_unproven_fault_fails_the_drill():
    """Nothing lost, every stream right, and still FAIL: the fault never showed."""
    records = [rec(0, COMPLETED, [5, 6, 7, 8]), rec(1, COMPLETED, [9, 10], prompt=1)]
    why = "the fault never fired: no fault_injected event (stall) from te0/worker0 within 15 s"
    report = build_report("stall-worker", records, REF, 4.0, 1000.0, None, 1001.0,
                          fault_proven=False, proof=why)
    assert (report.lost, report.bad_streams) == (0, 0) and not report.ok
    assert report.to_dict()["fault_proven"] is False and report.to_dict()["proof"] == why
    verdict = report.to_text().splitlines()[-1]
    assert verdict.startswith("verdict")
    assert "FAIL (fault not proven: the fault never fired" in verdict
    proven = build_report("stall-worker", records, REF, 4.0, 1000.0, None, 1001.0,
                          fault_proven=True, proof="te0/worker0 fault_injected stall +0.1 s")
    assert proven.ok and "PASS" in proven.to_text()


def test_missing_reference_or_status_is_an_error():
    with pytest.raises(ValueError, match="no reference"):
        build_report("s", [rec(0, COMPLETED, [1], prompt=7)], REF, None, None, None, None)
    with pytest.raises(ValueError, match="status"):
        build_report("s", [rec(0, None, [5])], REF, None, None, None, None)
