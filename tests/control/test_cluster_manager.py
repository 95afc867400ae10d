"""The cluster manager's first-publish rule: a (re)started CM lists no TE
before its TEs have had time to re-announce themselves (issue 11: a fresh
CM published [] at once and the JE failed every task)."""

from __future__ import annotations

import time
import typing

import pytest
import zmq

from deepserve.control.cm import cluster_manager
from deepserve.control.cm.cluster_manager import ClusterManager
from deepserve.ipc.sockets import PushSocket, SubSocket, ipc_address
from deepserve.messages.control import (FromClusterManager, TEDown, TEInfo, TEList, TEUp,
                                        ToClusterManager)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def _te_up(te_id: str) -> TEUp:
    return TEUp(info=TEInfo(te_id=te_id, model="m", address=f"ipc:///tmp/{te_id}"))


class _Wire:
    """A CM with a TE-side PUSH and a JE-side SUB, run by hand."""

    def __init__(self, ctx, tmp_path, **options):
        inbox, pub = ipc_address(tmp_path, "cm"), ipc_address(tmp_path, "cm-pub")
        self.cm = ClusterManager(ctx, inbox, pub, te_timeout_s=60.0, **options)
        self.te = PushSocket(ctx, inbox, bind=False)
        self.sub = SubSocket(ctx, pub, bind=False, type=FromClusterManager)
        time.sleep(0.2)  # the SUB's subscription reaches the PUB

    def run(self, seconds: float, complete: bool = True) -> list[TEList]:
        """The TE lists published in `seconds` (complete: only those that list TEs)."""
        lists = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.cm.step(timeout=0.02)
            lists += [m for m in self.sub.drain()
                      if isinstance(m, TEList) and (m.is_complete or not complete)]
        return lists

    def close(self) -> None:
        for sock in (self.te, self.sub):
            sock.close()
        self.cm.close()


def test_a_fresh_cm_publishes_no_te_list_before_its_tes_reannounce(ctx, tmp_path):
    """Fails on the old CM: it published TEList([]) on its first step."""
    wire = _Wire(ctx, tmp_path)
    try:
        assert wire.run(1.2) == []  # inside the default grace (3 s): silence
    finally:
        wire.close()


def test_within_its_grace_a_cm_sends_only_an_empty_incomplete_list_each_second(ctx, tmp_path):
    """Its sign of life for a standby head (supervisor/head_watch.py): without
    it a CM restarting on a live head is silent for the whole grace, and the
    standby takes over from a head that was coming back."""
    wire = _Wire(ctx, tmp_path)
    try:
        wire.te.put(_te_up("te0"))
        beacons = wire.run(1.5, complete=False)  # inside the grace (3 s)
        assert 1 <= len(beacons) <= 2, beacons  # at once, then after REPUBLISH_S
        assert all(not b.is_complete and b.tes == [] for b in beacons)
        assert {b.cm_incarnation for b in beacons} == {wire.cm.incarnation}
    finally:
        wire.close()


def test_first_list_after_the_grace_holds_every_reannounced_te(ctx, tmp_path):
    wire = _Wire(ctx, tmp_path, grace_s=0.6)
    try:
        wire.te.put(_te_up("te0"))
        early = wire.run(0.3)
        wire.te.put(_te_up("te1"))  # the second TE re-announces later in the grace
        lists = early + wire.run(0.8)
        assert early == []
        assert lists, "no TE list after the grace"
        first = lists[0]
        assert sorted(te.te_id for te in first.tes) == ["te0", "te1"]  # never partial
        assert first.is_complete and first.cm_incarnation == wire.cm.incarnation
    finally:
        wire.close()


def test_grace_rule_with_a_fake_clock(ctx, tmp_path):
    now = [100.0]
    wire = _Wire(ctx, tmp_path, grace_s=3.0, clock=lambda: now[0])
    try:
        assert not wire.cm.is_listing
        assert wire.run(0.2) == []
        now[0] = 102.9
        assert wire.run(0.2) == []
        now[0] = 103.0
        lists = wire.run(0.3)
        assert [lst.tes for lst in lists][:1] == [[]]  # after the grace an empty list is the truth
    finally:
        wire.close()


def test_incarnations_differ(ctx, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _Wire(ctx, tmp_path / "a"), _Wire(ctx, tmp_path / "b")
    try:
        assert a.cm.incarnation != b.cm.incarnation
    finally:
        a.close()
        b.close()


def test_the_first_list_comes_as_soon_as_every_configured_te_announced(ctx, tmp_path):
    now = [0.0]
    wire = _Wire(ctx, tmp_path, grace_s=3.0, expected_tes=("te0", "te1"), clock=lambda: now[0])
    try:
        wire.te.put(_te_up("te0"))
        assert wire.run(0.3) == []  # te1 not heard yet, grace not over
        wire.te.put(_te_up("te1"))
        lists = wire.run(0.3)
        assert lists and sorted(te.te_id for te in lists[0].tes) == ["te0", "te1"]
        assert now[0] == 0.0  # long before the grace's end
    finally:
        wire.close()


def test_a_stale_te_up_right_after_te_down_does_not_relist_the_te(ctx, tmp_path):
    """A dying TE's host may send one more TEUp after the supervisor's TEDown:
    within REUP_FENCE_S it is ignored; a restarted TE's TEUp later lists it."""
    now = [0.0]
    wire = _Wire(ctx, tmp_path, grace_s=0.0, clock=lambda: now[0])
    try:
        wire.te.put(_te_up("te0"))
        assert [te.te_id for te in wire.run(0.3)[-1].tes] == ["te0"]
        wire.te.put(TEDown(te_id="te0", reason="supervisor: worker0 fault", part="worker0"))
        down = wire.run(0.3)[-1]
        assert down.tes == [] and down.down == {"te0": "worker0"}  # the part: for the JE
        now[0] = 0.3
        wire.te.put(_te_up("te0"))  # stale
        assert wire.run(0.3) == []  # no change: nothing published
        now[0] = 1.5  # a republish
        assert [(lst.tes, lst.down) for lst in wire.run(0.3)] == [([], {"te0": "worker0"})]
        now[0] = cluster_manager.REUP_FENCE_S + 0.1
        wire.te.put(_te_up("te0"))  # the restarted TE
        relisted = wire.run(0.3)[-1]
        assert [te.te_id for te in relisted.tes] == ["te0"] and relisted.down == {}
    finally:
        wire.close()


def test_a_new_incarnation_passes_the_fence_at_once_and_the_old_one_does_not(ctx, tmp_path):
    """A pre-warmed process replaces a TE faster than REUP_FENCE_S: its TEUp
    names a new incarnation and lists it; the dead one's stale TEUp does not."""
    import msgspec
    now = [0.0]
    wire = _Wire(ctx, tmp_path, grace_s=0.0, clock=lambda: now[0])
    up = lambda inc: TEUp(info=msgspec.structs.replace(_te_up("te0").info,  # noqa: E731
                                                       incarnation=inc))
    try:
        wire.te.put(up("run-0"))
        assert [te.te_id for te in wire.run(0.3)[-1].tes] == ["te0"]
        wire.te.put(TEDown(te_id="te0", reason="supervisor: process fault"))
        assert wire.run(0.3)[-1].tes == []
        now[0] = 0.2
        wire.te.put(up("run-0"))  # the dead incarnation, late: fenced
        assert wire.run(0.3) == []
        now[0] = 0.4
        wire.te.put(up("run-1"))  # its replacement: listed now
        [info] = wire.run(0.3)[-1].tes
        assert (info.te_id, info.incarnation) == ("te0", "run-1")
    finally:
        wire.close()


def test_a_second_te_of_a_listed_id_is_refused_and_cannot_take_it_down(ctx, tmp_path):
    """Two nodes of one [cluster] name both announce h1-te0: the TE listed first
    keeps the id while it reports; the newcomer is refused (one te_id_conflict
    event, however often it announces), and its TEDown leaves the listed TE up.
    Once the listed TE went silent past te_timeout_s, the id is free again."""
    import msgspec
    now = [0.0]
    events = []
    wire = _Wire(ctx, tmp_path, grace_s=0.0, clock=lambda: now[0],
                 events=lambda event, **d: events.append((event, d)))
    at = lambda address: TEUp(info=msgspec.structs.replace(  # noqa: E731
        _te_up("h1-te0").info, address=address))
    try:
        wire.te.put(at("tcp://10.0.0.2:7408"))
        assert [te.address for te in wire.run(0.3)[-1].tes] == ["tcp://10.0.0.2:7408"]
        for t in (1.0, 2.0):
            now[0] = t
            wire.te.put(at("tcp://10.0.0.3:7408"))
            assert [te.address for lst in wire.run(0.3) for te in lst.tes] \
                == ["tcp://10.0.0.2:7408"] * (t == 2.0)  # a republish at most, never the newcomer
        conflicts = [d for e, d in events if e == "te_id_conflict"]
        assert [d["address"] for d in conflicts] == ["tcp://10.0.0.3:7408"]
        wire.te.put(TEDown(te_id="h1-te0", reason="shutdown", address="tcp://10.0.0.3:7408"))
        wire.te.put(at("tcp://10.0.0.2:7408"))  # the listed TE reports on
        wire.run(0.3)
        assert wire.cm.tes["h1-te0"].address == "tcp://10.0.0.2:7408"
        now[0] = 2.0 + wire.cm.te_timeout_s + 0.1  # the listed one went silent: dropped...
        wire.run(0.3)
        assert "h1-te0" not in wire.cm.tes
        wire.te.put(at("tcp://10.0.0.3:7408"))  # ...and the id is free for the other
        wire.run(0.3)
        assert wire.cm.tes["h1-te0"].address == "tcp://10.0.0.3:7408"
        wire.te.put(TEDown(te_id="h1-te0", reason="shutdown", address="tcp://10.0.0.3:7408"))
        wire.run(0.3)
        assert "h1-te0" not in wire.cm.tes  # its own TEDown (and an address-less one) count
    finally:
        wire.close()


def test_every_message_of_the_cm_inbox_has_a_handler(ctx, tmp_path):
    """handle() dispatches on the message's type: a type added to the channel
    without a handler would be dropped silently."""
    wire = _Wire(ctx, tmp_path)
    try:
        assert set(wire.cm._handlers) == set(typing.get_args(ToClusterManager))
    finally:
        wire.close()
