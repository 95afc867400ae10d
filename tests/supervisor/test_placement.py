"""Gang placement as a pure function: exact decisions, no processes."""

from __future__ import annotations

import itertools

import pytest

from deepserve.supervisor.placement import Eviction, Gang, Placement, place


def _reason(te: Gang, other: Gang) -> str:
    return (f"{te.te_id} (priority {te.priority}) needs {te.num_devices} devices together; "
            f"{other.te_id} has priority {other.priority}")


def test_no_device_limit_places_everything():
    placed = [Gang("a", 8, 9), Gang("b", 8, 9)]
    assert place(placed, None, Gang("c", 100, 0)) == Placement(True)


@pytest.mark.parametrize("num_placed_devices", [0, 1, 2])
def test_fits_without_eviction(num_placed_devices):
    placed = [Gang(f"p{i}", 1, 0) for i in range(num_placed_devices)]
    decision = place(placed, 4, Gang("new", 2, 5))
    assert decision == Placement(True)
    assert decision.victims == () and decision.reason == ""


def test_exactly_full_fits():
    assert place([Gang("a", 2, 0)], 4, Gang("b", 2, 0)) == Placement(True)


def test_evicts_lowest_priority_first_and_only_as_many_as_needed():
    placed = [Gang("mid", 1, 2), Gang("low", 1, 0), Gang("lowish", 1, 1), Gang("high", 1, 9)]
    te = Gang("new", 2, 5)
    decision = place(placed, 4, te)
    assert decision.is_placed
    assert decision.victims == (Eviction("low", 1, _reason(te, placed[1])),
                                Eviction("lowish", 1, _reason(te, placed[2])))


def test_equal_priorities_are_evicted_in_start_order():
    placed = [Gang("a", 1, 0), Gang("b", 1, 0), Gang("c", 1, 0)]
    decision = place(placed, 3, Gang("big", 2, 1))
    assert [v.te_id for v in decision.victims] == ["a", "b"]


def test_a_big_victim_can_free_more_than_needed():
    placed = [Gang("wide", 4, 0), Gang("keep", 2, 3)]
    te = Gang("new", 1, 1)
    decision = place(placed, 6, te)
    assert decision == Placement(True, (Eviction("wide", 4, _reason(te, placed[0])),))


def test_the_gang_scheduling_node_example():
    """tests/supervisor/test_supervisor.py's node: te2 (tp 2) evicts te0 and te1; te3 stays down."""
    te0, te1, te2, te3 = Gang("te0", 1, 0), Gang("te1", 1, 0), Gang("te2", 2, 1), Gang("te3", 1, 0)
    first = place([te0, te1], 2, te2)
    assert [v.te_id for v in first.victims] == ["te0", "te1"]
    assert all("te2 (priority 1) needs 2 devices" in v.reason for v in first.victims)
    refused = place([te2], 2, te3)
    assert refused == Placement(False, reason=(
        "needs 1 devices together; 0 of 2 can be freed "
        "(no lower-priority TE holds the rest): not started"))


@pytest.mark.parametrize("holder_priority", [5, 7])
def test_refuses_when_equal_or_higher_priority_holds_the_devices(holder_priority):
    placed = [Gang("low", 1, 0), Gang("holder", 2, holder_priority)]
    decision = place(placed, 3, Gang("new", 2, 5))
    assert not decision.is_placed
    assert decision.victims == ()  # nobody is evicted for a TE that cannot start anyway
    assert decision.reason == ("needs 2 devices together; 1 of 3 can be freed "
                               "(no lower-priority TE holds the rest): not started")


def test_refuses_a_te_wider_than_the_node():
    decision = place([], 2, Gang("huge", 4, 100))
    assert decision == Placement(False, reason=(
        "needs 4 devices together; 2 of 2 can be freed "
        "(no lower-priority TE holds the rest): not started"))


def test_every_small_case_against_brute_force():
    """For every placement of up to 3 TEs on 4 devices: a placed decision frees
    enough, evicts only strictly lower priorities in ascending (stable) order,
    and stops at the first prefix that frees enough; a refusal happens exactly
    when evicting every lower-priority TE would not be enough."""
    shapes = [(d, p) for d in (1, 2, 3) for p in (0, 1, 2)]
    for n in range(4):
        for combo in itertools.product(shapes, repeat=n):
            placed = [Gang(f"t{i}", d, p) for i, (d, p) in enumerate(combo)]
            if sum(g.num_devices for g in placed) > 4:
                continue
            for d, p in shapes:
                _check(placed, Gang("new", d, p))


def _check(placed: list[Gang], te: Gang) -> None:
    decision = place(placed, 4, te)
    free = 4 - sum(g.num_devices for g in placed)
    lower = sorted((g for g in placed if g.priority < te.priority), key=lambda g: g.priority)
    if free + sum(g.num_devices for g in lower) < te.num_devices:
        assert not decision.is_placed and decision.victims == ()
        return
    assert decision.is_placed
    want, freed = [], free
    for g in lower:
        if freed >= te.num_devices:
            break
        want.append(g.te_id)
        freed += g.num_devices
    assert [v.te_id for v in decision.victims] == want
