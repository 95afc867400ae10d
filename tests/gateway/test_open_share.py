"""The gateway's open-request cap shared among tenants (gateway/link/open_share.py),
each rule at its boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepserve.gateway.link.open_share import admits, open_by_tenant


def test_under_the_cap_anyone_is_admitted():
    assert admits({"a": 3}, "a", 1, 4)  # exactly at the cap after it
    assert admits({}, "b", 4, 4)
    assert not admits({}, "b", 5, 4)  # alone, the share is the whole cap


def test_at_the_cap_a_tenant_under_its_equal_share_still_gets_in():
    open_by = {"a": 4}
    assert not admits(open_by, "a", 1, 4)  # a holds it all
    assert admits(open_by, "b", 2, 4)  # b: 0 + 2 <= 4 / 2
    assert not admits(open_by, "b", 3, 4)  # one past its share
    open_by = {"a": 4, "b": 2}
    assert not admits(open_by, "b", 1, 4)
    assert admits(open_by, "c", 1, 4) and not admits(open_by, "c", 2, 4)  # 4 / 3
    assert admits({"a": 4, "b": 0}, "c", 2, 4)  # b holds nothing: not counted


@dataclass
class _Stream:
    tenant: str
    request_ids: list[str] = field(default_factory=lambda: ["r-0"])
    is_closed: bool = False


def test_open_requests_are_counted_by_tenant_n_counts_n_closed_do_not():
    streams = [_Stream("a", ["x-0", "x-1"]), _Stream("a"), _Stream("b"),
               _Stream("b", is_closed=True)]
    assert open_by_tenant(streams) == {"a": 3, "b": 1}
