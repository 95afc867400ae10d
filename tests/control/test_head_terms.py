"""Head terms (supervisor/head_terms.py, messages/control.py TermFence, the
cluster manager's step-down): one head at a time, even with two alive."""

from __future__ import annotations

import threading

import pytest
import zmq

from deepserve.messages.control import TEList, TermFence
from deepserve.messages.scaling import NodeReport
from deepserve.supervisor.head_terms import HeadTerms
from tests.control.test_cluster_manager import _te_up, _Wire


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def test_a_fence_keeps_the_newest_terms_lists_only():
    fence = TermFence()
    assert fence.admits(TEList(tes=[], term=1)) and fence.highest == 1
    assert fence.admits(TEList(tes=[], term=2, is_complete=False))  # a new CM's beacon
    assert not fence.admits(TEList(tes=[], term=1))  # the deposed head's
    assert fence.admits(TEList(tes=[], term=2)) and fence.num_fenced == 1
    assert fence.admits(NodeReport(node="n", run_id="r", address="a"))  # not a list: passes


def test_claims_go_past_every_recorded_term_and_each_term_has_one_claimant(tmp_path):
    a, b = HeadTerms(str(tmp_path), "10.0.0.1:7400"), HeadTerms(str(tmp_path), "10.0.0.2:7400")
    assert a.highest_recorded() == 0
    assert a.claim(1) == 1 and b.claim(1) == 2  # past the recorded 1
    assert (tmp_path / "terms" / "2").read_text() == "10.0.0.2:7400\n"
    got: list = []
    racers = [threading.Thread(target=lambda t=t: got.append(t.claim(3)))
              for t in (a, b) for _ in range(4)]
    for r in racers:
        r.start()
    for r in racers:
        r.join(5)
    claimed = [t for t in got if t is not None]
    assert len(claimed) == len(set(claimed))  # no term twice
    assert (tmp_path / "terms" / "3").is_file() and 3 in claimed
    assert (tmp_path / "terms" / "3").stat().st_mode & 0o777 == 0o600
    assert HeadTerms("", "x").claim(5) == 5  # no state_dir: the term asked


def test_a_cm_that_hears_a_higher_term_steps_down_and_publishes_no_more(ctx, tmp_path):
    events = []
    wire = _Wire(ctx, tmp_path, grace_s=0.0, term=1,
                 events=lambda event, **details: events.append((event, details)))
    try:
        wire.te.put(_te_up("te0"))
        lists = wire.run(0.3)
        assert lists and all(m.term == 1 for m in lists)
        wire.te.put(NodeReport(node="n2", run_id="r", address="a", term=1))  # same: stays
        wire.run(0.2)
        assert wire.cm.deposed_by is None and not [e for e, _ in events if e != "te_list_complete"]
        wire.te.put(NodeReport(node="n2", run_id="r", address="a", term=2))  # the fault
        wire.run(0.3)
        assert wire.cm.deposed_by == 2
        assert [e for e in events if e[0] == "head_stepped_down"] == [
            ("head_stepped_down", {"term": 1, "new_term": 2, "heard_from": "n2"})]
        wire.sub.drain()
        assert wire.run(1.5, complete=False) == []  # silent from then on
    finally:
        wire.close()
