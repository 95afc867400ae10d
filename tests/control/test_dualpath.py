"""DualPath's two-level scheduler, exactly (PAPERS.md 2.6)."""

import pytest

from deepserve.control.je.routing.dualpath import (DECODE_PATH, PREFILL_PATH, DualPathScheduler,
                                        EngineLoad as E)


@pytest.fixture
def s():
    return DualPathScheduler(alpha_tokens=100, beta_tokens=1000)


def test_prefill_classes_short_queue_first_overloaded_never(s):
    pes = [E("p0", tokens=10, read_queue=500),  # C3: long read queue
           E("p1", tokens=300, read_queue=50),  # C2
           E("p2", tokens=5, read_queue=0) and E("p2", tokens=2000, read_queue=0)]  # C1
    assert s.choose_prefill(64, pes).te_id == "p1"  # C2 beats a less loaded C3
    assert s.choose_prefill(64, pes[:1] + pes[2:]).te_id == "p0"  # no C2: C3
    assert s.choose_prefill(64, pes[2:]) is None  # only overloaded: wait


def test_decode_group_then_z_then_fewest_requests(s):
    des = [E("d0", tokens=100, num_seqs=5, group="a"), E("d1", tokens=100, num_seqs=1, group="a"),
           E("d2", tokens=50, num_seqs=0, group="b"), E("d3", tokens=400, num_seqs=0, group="b")]
    # group a has 200 tokens, b 450: a. need 10: Z = 1.05 * 210 / 2 = 110.25, both stay
    # under it: the one with fewer requests
    assert s.choose_decode(10, des).te_id == "d1"
    # need 100: Z = 157.5, both would pass it: the least loaded (a tie: by id)
    assert s.choose_decode(100, des).te_id == "d0"
    uneven = [E("d0", tokens=100, num_seqs=5), E("d1", tokens=10, num_seqs=9)]
    uneven = [E(e.te_id, e.tokens, e.num_seqs, group="a") for e in uneven]
    # Z(20) = 1.05 * 130 / 2 = 68.25: d0 (120) is a high-token DE, d1 (30) is not
    assert s.choose_decode(20, uneven).te_id == "d1"
    full = [E("d0", tokens=0, free_tokens=50, group="a"), E("d2", tokens=900, group="b")]
    assert s.choose_decode(100, full).te_id == "d2"  # a has no room: b, however loaded
    assert s.choose_decode(100, [E("d0", free_tokens=50)]) is None


def test_the_read_goes_to_the_shorter_queue_and_loads_move_until_reported(s):
    pes, des = [E("p0", read_queue=80)], [E("d0", read_queue=10)]
    first = s.choose(500, 20, pes, des)
    assert (first.prefill_te, first.decode_te, first.read_path) == ("p0", "d0", DECODE_PATH)
    second = s.choose(500, 20, pes, des)  # d0's queue now holds the first read: 510 > 80
    assert second.read_path == PREFILL_PATH
    assert s.assigned == {"p0": 1000, "d0": 1040} and s.assigned_reads == {"d0": 500, "p0": 500}
    s.on_report("d0")
    assert "d0" not in s.assigned and s.assigned["p0"] == 1000


def test_a_decision_carries_what_it_compared(s):
    d = s.choose(500, 20, [E("p0", read_queue=80)], [E("d0", read_queue=10)])
    assert d.details() == {"prefill_te": "p0", "decode_te": "d0", "read_path": DECODE_PATH,
                           "pe_read_queue": 80, "de_read_queue": 10, "pe_reads": 0,
                           "de_reads": 0}
    s.on_report("d0")  # a tie on the queues: what each side was given to read decides
    d = s.choose(10, 1, [E("p0", read_queue=80)], [E("d0", read_queue=80)])
    assert (d.read_path, d.pe_reads, d.de_reads) == (PREFILL_PATH, 0, 500)


def test_a_tie_reads_where_less_was_read_then_on_the_prefill_side(s):
    assert s.choose(10, 1, [E("p0")], [E("d0")]).read_path == PREFILL_PATH
    s.on_report("p0")
    s.on_report("d0")  # queues equal again: p0 has been given 10 tokens to read, d0 none
    assert s.choose(10, 1, [E("p0")], [E("d0")]).read_path == DECODE_PATH
    assert s.total_reads == {"p0": 10, "d0": 10}


def test_no_engine_means_wait(s):
    assert s.choose(10, 1, [], [E("d0")]) is None
    assert s.choose(10, 1, [E("p0", tokens=5000)], [E("d0")]) is None


def test_bad_parameters_are_refused():
    for kw in ({"alpha_tokens": -1}, {"beta_tokens": 0}, {"z_factor": 0.9}):
        with pytest.raises(ValueError):
            DualPathScheduler(**kw)


def test_the_prefill_only_baseline_never_reads_on_the_decode_side():
    s = DualPathScheduler(read_paths="prefill")
    assert s.choose(10, 1, [E("p0", read_queue=900)], [E("d0")]).read_path == PREFILL_PATH
    with pytest.raises(ValueError):
        DualPathScheduler(read_paths="decode")
