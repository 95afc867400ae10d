"""The drill's poison hook on a worker: exit 13 when a step carries the marker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepserve.faults import FaultHooks
from deepserve.messages.step import ScheduledSeq, StepBatch
from deepserve.worker import worker_actor
from deepserve.worker.worker_actor import _Worker, _contains


def test_contains_a_contiguous_run_only():
    assert _contains([5, 7, 9, 11], [7, 9]) and _contains([7, 9], [7, 9])
    assert not _contains([7, 8, 9], [7, 9]) and not _contains([1, 2], [])
    assert not _contains([7], [7, 9])


def _batch(*chunks):
    return StepBatch(step_id=3, seqs=[ScheduledSeq(seq_id=i, start=0, token_ids=list(c),
                                                   block_table=[0], do_sample=True)
                                      for i, c in enumerate(chunks)])


def test_exits_13_on_the_marker_and_reports_the_firing(tmp_path, monkeypatch):
    fired = []
    faults = FaultHooks(tmp_path, "te0/worker0", interval_s=0.0,
                        on_fired=lambda fault, value: fired.append((fault, value)))
    worker = SimpleNamespace(life=SimpleNamespace(faults=faults))
    exits = []
    monkeypatch.setattr(worker_actor.os, "_exit", lambda code: exits.append(code))
    _Worker._drill_poison(worker, _batch([1, 7, 9, 2]))
    assert exits == [] and fired == []  # no hook file: nothing happens
    faults.path("poison").write_text("7,9\n")
    _Worker._drill_poison(worker, _batch([1, 2, 3], [4, 7, 8, 9]))
    assert exits == [] and fired == [("poison", "7,9")]  # armed, no marker in this step
    _Worker._drill_poison(worker, _batch([1, 2, 3], [4, 7, 9]))
    assert exits == [13]


@pytest.mark.parametrize("content", ["", " , ", "POISON"])
def test_an_empty_or_bad_marker_never_fires(tmp_path, monkeypatch, content):
    faults = FaultHooks(tmp_path, "te0/worker0", interval_s=0.0)
    faults.path("poison").write_text(content)
    monkeypatch.setattr(worker_actor.os, "_exit", pytest.fail)
    _Worker._drill_poison(SimpleNamespace(life=SimpleNamespace(faults=faults)), _batch([1, 2]))
