"""The poison drill's pieces, no node: the proof, the restart count, recovery."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from deepserve.drill.health_events import HealthEvents
from deepserve.drill.poison import (PoisonRequest, Quarantined, has_recovered, poison_ids,
                                    summary, te_restarts)
from deepserve.drill.stream import COMPLETED, FAILED, RequestRecord


def _log(tmp_path, *events):
    lines = []
    for t, component, event, details in events:
        iso = datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")
        lines.append(json.dumps({"time": iso.replace("+00:00", "Z"), "node": "n",
                                 "component": component, "pid": 1, "event": event,
                                 "details": details}))
    (tmp_path / "health.jsonl").write_text("\n".join(lines) + "\n")
    return HealthEvents(tmp_path)


def _poison(status=FAILED, code="request_crashed_engine", end=105.0):
    p = PoisonRequest(driver=None, prompt_ids=[1])
    p.record = RequestRecord(id=-1, prompt_index=-1, max_tokens=4, start=100.0, end=end,
                             status=status, error_code=code, http_status=500)
    return p


def test_marker_ids_from_the_tokenizer(tiny_model):
    marker, prompt = poison_ids(str(tiny_model))
    assert len(marker) >= 3 and prompt[-len(marker):] == marker and len(prompt) > len(marker)


def test_quarantined_needs_the_event_and_the_clients_error(tmp_path):
    events = _log(tmp_path, (101.0, "te0", "restarting", {}),
                  (103.0, "job-executor", "request_quarantined",
                   {"request_id": "cmpl-1-0", "crashed_tes": ["te0", "te1"]}))
    proof = Quarantined(events, _poison(), since=100.0)
    proof.poll(104.0)
    assert proof.is_proven and "crashes of ['te0', 'te1']" in proof.evidence[0]
    wrong = Quarantined(events, _poison(status=COMPLETED, code=None), since=100.0)
    wrong.poll(104.0)
    assert wrong.failure is not None and not wrong.is_proven
    none = Quarantined(_log(tmp_path), _poison(), since=100.0)
    none.poll(104.0)
    assert not none.is_settled
    none.finish([])
    assert "no request_quarantined" in none.failure


def test_an_innocent_quarantined_too_fails_the_proof(tmp_path):
    events = _log(tmp_path, *[(103.0 + i, "job-executor", "request_quarantined",
                               {"request_id": f"cmpl-{i}-0", "crashed_tes": ["te0", "te1"]})
                              for i in range(2)])
    proof = Quarantined(events, _poison(), since=100.0)
    proof.poll(106.0)
    assert "2 requests quarantined" in proof.failure


def test_restarts_recovery_and_summary(tmp_path):
    events = _log(tmp_path, (99.0, "te1", "restarting", {}),
                  (101.0, "te0", "restarting", {}), (102.0, "te1", "restarting", {}),
                  (104.0, "te0", "recovered", {}))
    assert te_restarts(events, 100.0) == ["te0", "te1"]
    done = RequestRecord(id=0, prompt_index=0, max_tokens=4, start=107.0, first_token=107.5,
                         end=108.0, status=COMPLETED)
    refused = RequestRecord(id=1, prompt_index=0, max_tokens=4, start=101.0, end=101.1,
                            status=FAILED, http_status=503, error_type="service_unavailable")
    assert not has_recovered(events, _poison(), 100.0, [done])  # te1 not back yet
    events = _log(tmp_path, (101.0, "te0", "restarting", {}), (104.0, "te0", "recovered", {}))
    assert has_recovered(events, _poison(), 100.0, [done])
    assert not has_recovered(events, PoisonRequest(None, [1]), 100.0, [done])
    s = summary(events, _poison(), 100.0, [done, refused])
    assert (s["te_restarts"], s["num_tes_restarted"], s["load_503"]) == (1, 1, 1)
    assert s["poison"]["error_code"] == "request_crashed_engine"


def test_recovery_waits_for_the_last_restart_of_a_te(tmp_path):
    """A poison request restarts its TE twice: back from the first restart is
    not recovered (the drill ended while te0 was down again)."""
    done = RequestRecord(id=0, prompt_index=0, max_tokens=4, start=112.0, first_token=112.5,
                         end=113.0, status=COMPLETED)
    events = _log(tmp_path, (101.0, "te0", "restarting", {}), (104.0, "te0", "recovered", {}),
                  (106.0, "te0", "restarting", {}))
    assert not has_recovered(events, _poison(), 100.0, [done])
    events = _log(tmp_path, (101.0, "te0", "restarting", {}), (104.0, "te0", "recovered", {}),
                  (106.0, "te0", "restarting", {}), (111.0, "te0", "recovered", {}))
    assert has_recovered(events, _poison(), 100.0, [done])
