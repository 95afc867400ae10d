"""Tenants inside a step (engine/scheduler.py): decodes, prefill chunks and
admissions shared by tenant weight when the step's budget or seats run short,
never leaving tokens unused that another tenant could take."""

from __future__ import annotations

import msgspec
import pytest

from deepserve.engine.tenant_shares import TenantShares, weighted_order
from deepserve.engine.sequence import Sequence
from deepserve.messages.engine import SubmitRequest
from deepserve.messages.sampling import SamplingParams
from tests.engine.test_scheduler import _scheduler, _seq, _step


def _of(seq: Sequence, tenant: str | None, weight: float = 1.0) -> Sequence:
    seq.tenant, seq.tenant_weight = tenant, weight
    return seq


def _tenants(seqs: list[Sequence]) -> str:
    return "".join(s.tenant or "-" for s in seqs)


def test_weighted_order_interleaves_tenants_by_weight_and_keeps_each_ones_order():
    a = [_of(_seq(i, 1), "A", 3.0) for i in range(1, 7)]
    b = [_of(_seq(i, 1), "B") for i in range(7, 10)]
    order = weighted_order(b[:1] + a + b[1:])
    assert _tenants(order) == "AAABAAABB"  # 3 of A's to each of B's (ties: the earlier)
    assert [s.seq_id for s in order if s.tenant == "A"] == [1, 2, 3, 4, 5, 6]
    assert [s.seq_id for s in order if s.tenant == "B"] == [7, 8, 9]
    one = [_of(_seq(i, 1), "A") for i in (3, 1, 2)]
    assert weighted_order(one) == one  # one tenant: as given
    assert _tenants(weighted_order([_of(_seq(1, 1), None), _of(_seq(2, 1), "B")])) == "-B"


def test_shares_split_the_budget_by_weight_and_give_what_one_leaves_to_the_others():
    a, b, c = _of(_seq(1, 100), "A", 3.0), _of(_seq(2, 100), "B"), _of(_seq(3, 5), "C")
    shares = TenantShares([a, b], 100)
    assert (shares.cap(a, 100), shares.cap(b, 100)) == (75, 25)  # 3 : 1
    shares.spend(a, 70)
    assert shares.cap(a, 100) == 5 and shares.cap(a, 3) == 3  # never past the budget left
    shares = TenantShares([a, b, c], 100)  # C needs 5 of its 20: A and B split the rest
    assert [shares.cap(s, 100) for s in (a, b, c)] == [72, 23, 5]  # 71.25, 23.75: +1 to A
    assert sum(shares.alloc.values()) == 100  # work-conserving, rounding included
    assert TenantShares([a], 100).cap(a, 100) == 100  # one tenant: all of it
    small = TenantShares([_of(_seq(4, 2), "A"), _of(_seq(5, 3), "B")], 100)
    assert small.alloc == {"A": 2, "B": 3}  # both satisfied: nobody is capped below need


def test_two_tenants_prefilling_share_the_step_by_weight():
    """A (weight 3) and B (weight 1) each have a long prompt: first come, first
    served would give A's whole budget of 16 to the one that came first."""
    s = _scheduler(budget=16)
    a, b = _of(_seq(1, 40), "A", 3.0), _of(_seq(2, 40), "B")
    s.add(a)
    s.add(b)
    step = _step(s)
    assert step == {1: 12, 2: 4}
    step = _step(s)  # both running now: prefill chunks shared the same way
    assert step == {1: 12, 2: 4}


def test_a_tenant_that_needs_less_leaves_the_rest_to_the_other():
    s = _scheduler(budget=16)
    s.add(_of(_seq(1, 40), "A"))
    s.add(_of(_seq(2, 3), "B"))  # needs 3 of its 8
    assert _step(s) == {1: 13, 2: 3}  # the step is as full as first come, first served


def test_seats_go_in_weighted_turn_when_max_num_seqs_binds():
    s = _scheduler(budget=64, max_seqs=4)
    for i in range(1, 5):  # A's four came first
        s.add(_of(_seq(i, 2), "A"))
    for i in range(5, 9):
        s.add(_of(_seq(i, 2), "B"))
    step = _step(s)
    assert sorted(step) == [1, 2, 5, 6]  # two seats each, not A's four


def test_one_tenant_is_scheduled_as_before():
    s = _scheduler(budget=16)
    s.add(_seq(1, 40))
    s.add(_seq(2, 40))
    assert _step(s) == {1: 16}  # first come, first served: no tenant, no shares


def test_a_tenant_weight_on_the_wire_is_checked_at_its_bounds():
    """What the TE decodes: a weight the scheduler divides by is > 0 and <= 1000
    ([tenants] weight's own bounds); anything else is refused as a bad message."""
    def wire(weight):
        msg = SubmitRequest(request_id="r", prompt="x", sampling=SamplingParams())
        data = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
        data["tenant_weight"] = weight
        return msgspec.msgpack.decode(msgspec.msgpack.encode(data), type=SubmitRequest)

    assert wire(1000).tenant_weight == 1000 and wire(0.001).tenant_weight == 0.001
    for bad in (0, -1, 1000.5, "3"):
        with pytest.raises(msgspec.ValidationError, match="tenant_weight"):
            wire(bad)
