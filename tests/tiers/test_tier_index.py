"""The tier service's bookkeeping: exact slots, eviction order, leases, pins."""

import pytest

from deepserve.messages.cache import NO_SLOT, ON_DISK
from deepserve.tiers.tier_index import VALID, WRITING, TierIndex

B = 100  # bytes per block


@pytest.fixture
def idx():
    index = TierIndex(num_slots=3, block_bytes=B)
    yield index
    index.check_integrity()


def write(index, hashes, now=0.0, **pin):
    lease, slots, error = index.reserve(hashes, now, **pin)
    assert error is None
    written = [s for s in slots if s != NO_SLOT]
    to_disk = index.commit(lease, written) if lease else []
    index.check_integrity()
    return slots, to_disk


def test_reserve_commit_lookup(idx):
    slots, to_disk = write(idx, [10, 11])
    assert slots == [0, 1] and to_disk == []  # no disk tier
    lease, hits = idx.lookup([10, 11, 12], 0.0)
    assert hits == [0, 1] and idx.readers[:2] == [1, 1]
    idx.release(lease)
    assert idx.readers[:2] == [0, 0]
    assert idx.reserve([10], 0.0) == (0, [NO_SLOT], None)  # present: nothing to write


def test_lookup_stops_at_the_first_miss(idx):
    write(idx, [1, 3])
    assert idx.lookup([1, 2, 3], 0.0)[1] == [0]
    assert idx.lookup([2, 1], 0.0) == (0, [])


def test_lru_eviction_skips_blocks_being_read(idx):
    write(idx, [1, 2, 3])
    lease, _ = idx.lookup([1], 0.0)  # 1 is being read
    slots, _ = write(idx, [4])
    assert slots == [1] and 2 not in idx.slot_of  # 2 was the oldest unread
    idx.lookup([3], 0.0)  # touch 3: 1 (read) and 3 (recent) stay
    slots, _ = write(idx, [5])
    assert idx.hash_of[slots[0]] == 5 and set(idx.slot_of) == {1, 3, 5}
    idx.release(lease)


def test_a_full_pool_of_read_slots_reserves_nothing(idx):
    write(idx, [1, 2, 3])
    idx.lookup([1, 2, 3], 0.0)
    lease, slots, _ = idx.reserve([9], 0.0)
    assert (lease, slots) == (0, [NO_SLOT])


def test_uncommitted_reservations_lapse(idx):
    lease, slots, _ = idx.reserve([1, 2], 0.0)
    assert [idx.state[s] for s in slots] == [WRITING, WRITING]
    assert idx.lookup([1], 1.0) == (0, [])  # not readable while written
    idx.expire(now=idx.lease_s + 1, wall_now=0.0)
    assert lease not in idx.leases and len(idx.free) == 3


def test_commit_of_part_frees_the_rest_and_ignores_foreign_slots(idx):
    lease, slots, _ = idx.reserve([1, 2], 0.0)
    idx.commit(lease, [slots[0], 2])  # 2 is not this lease's slot
    assert idx.state[slots[0]] == VALID and 2 not in idx.slot_of
    assert idx.commit(lease, [slots[0]]) == []  # a second commit is a no-op


def test_a_held_commit_keeps_its_slots_read_pinned_until_released():
    idx = TierIndex(num_slots=5, block_bytes=B)
    lease, slots, _ = idx.reserve([1, 2], 0.0)
    idx.commit(lease, slots, hold=True)  # a decode TE's staged blocks
    assert [idx.state[s] for s in slots] == [VALID, VALID]
    reader, hits = idx.lookup([1, 2], 0.1)  # readable by the prefill TE meanwhile
    assert hits == slots
    idx.release(reader)
    for h in (3, 4, 5, 6):  # the other three slots fill and turn over; the held two stay
        write(idx, [h])
    assert 3 not in idx.slot_of and idx.slot_of[1] == slots[0] and idx.slot_of[2] == slots[1]
    idx.release(lease)  # now they are ordinary LRU blocks again
    assert idx.readers[slots[0]] == idx.readers[slots[1]] == 0
    idx.check_integrity()


def test_a_commit_holds_only_while_half_the_slots_are_free_of_readers():
    idx = TierIndex(num_slots=4, block_bytes=B)
    first, slots, _ = idx.reserve([1, 2], 0.0)
    idx.commit(first, slots, hold=True)  # 2 of 4: held
    second, more, _ = idx.reserve([3], 0.0)
    idx.commit(second, more, hold=True)  # would be 3 of 4: committed, not held
    assert first in idx.leases and second not in idx.leases
    assert idx.readers[more[0]] == 0
    idx.check_integrity()


def test_a_staging_reserve_gets_only_the_slots_a_hold_can_keep():
    """hold=True (DualPath's decode-path staging): new slots only while half the
    pool minus the read-pinned slots minus the staging slots reserved and not
    committed yet has room, in block order; the rest NO_SLOT and counted. A
    block staged past that would be committed unpinned and evicted before its
    prefill TE loads it: read from storage twice."""
    idx = TierIndex(num_slots=8, block_bytes=B)
    write(idx, [1])
    pinned, _ = idx.lookup([1], 0.0)  # 1 slot read-pinned: room for 4 - 1 = 3
    first, slots, _ = idx.reserve([1, 2, 3, 4, 5], 0.0, hold=True)
    assert slots[0] == NO_SLOT and all(s != NO_SLOT for s in slots[1:4])  # 1: present
    assert slots[4] == NO_SLOT and idx.holds_cut == 1  # the 4th new block: no room
    second, more, _ = idx.reserve([6, 7], 0.0, hold=True)  # the first's 3 are pending
    assert more == [NO_SLOT, NO_SLOT] and second == 0 and idx.holds_cut == 3
    plain, fresh, _ = idx.reserve([6, 7], 0.0)  # a write-through is not limited
    assert NO_SLOT not in fresh
    idx.commit(first, slots[1:4], hold=True)  # 1 + 3 = 4 of 8 read-pinned: held
    assert first in idx.leases and all(idx.readers[s] == 1 for s in slots[1:4])
    idx.commit(plain, fresh)
    idx.release(pinned)
    _, last, _ = idx.reserve([8, 9], 0.0, hold=True)  # 3 held: room for 1
    assert last[0] != NO_SLOT and last[1] == NO_SLOT
    idx.release(first)
    idx.check_integrity()


def test_a_held_commit_lapses_with_its_lease(idx):
    lease, slots, _ = idx.reserve([1], 0.0)
    idx.commit(lease, slots, hold=True)
    idx.expire(now=idx.lease_s + 1, wall_now=0.0)
    assert lease not in idx.leases and idx.readers[slots[0]] == 0


def test_disk_write_through_and_disk_lru():
    idx = TierIndex(num_slots=2, block_bytes=B, disk_budget=2 * B)
    _, to_disk = write(idx, [1, 2])
    assert to_disk == [(0, 1), (1, 2)] and idx.readers == [1, 1]
    assert idx.disk_written(0, 1, B, ok=True) == []
    assert idx.disk_written(1, 2, B, ok=False) == []  # a failed write: not on disk
    _, to_disk = write(idx, [3])  # evicts host copy of... nothing free: slot 0 (1, oldest)
    assert to_disk == [(0, 3)]
    assert idx.disk_written(0, 3, B, ok=True) == []
    assert idx.lookup([1, 3], 0.0)[1] == [ON_DISK, 0]
    _, to_disk = write(idx, [4])  # 2 (never on disk) leaves the host pool
    assert 2 not in idx.slot_of
    # 3 files over a budget of 2: the oldest unread one goes (1 is being read)
    assert idx.disk_written(to_disk[0][0], 4, B, ok=True) == [3]
    idx.release(max(idx.leases))
    idx.check_integrity()
    _, to_disk = write(idx, [5])
    assert idx.disk_written(to_disk[0][0], 5, B, ok=True) == [1]  # now 1 is the oldest
    idx.check_integrity()


def test_context_pins_hold_blocks_and_unpin_frees_them_everywhere():
    idx = TierIndex(num_slots=2, block_bytes=B, disk_budget=3 * B, pin_budget=2 * B)
    baseline = (len(idx.free), idx.disk_bytes)
    lease, slots, err = idx.reserve([1, 2], 0.0, context_id="ctx-a", expires_at=100.0)
    for slot, h in idx.commit(lease, slots):
        idx.disk_written(slot, h, B, ok=True)
    _, to_disk = write(idx, [3, 4])  # pinned host copies may go: they are on disk
    for slot, h in to_disk:
        idx.disk_written(slot, h, B, ok=True)
    assert set(idx.slot_of) == {3, 4} and {1, 2} <= set(idx.disk)
    _, to_disk = write(idx, [5, 6])
    files = [f for slot, h in to_disk for f in idx.disk_written(slot, h, B, ok=True)]
    assert 1 in idx.disk and 2 in idx.disk and set(files) == {4, 5}  # pinned files stay
    idx.check_integrity()
    assert sorted(idx.unpin("ctx-a")) == [1, 2]
    assert 1 not in idx.disk and 2 not in idx.disk and not idx.pins
    idx.check_integrity()
    assert idx.disk_bytes <= 3 * B and baseline[0] == 2


def test_pins_over_budget_are_refused_whole():
    idx = TierIndex(num_slots=4, block_bytes=B, pin_budget=2 * B)
    assert idx.reserve([1, 2], 0.0, context_id="a", expires_at=9.0)[2] is None
    assert idx.reserve([1, 3], 0.0, context_id="b", expires_at=9.0)[2] == "over_budget"
    assert set(idx.pins) == {1, 2} and "b" not in idx.contexts
    assert idx.reserve([1, 2], 0.0, context_id="b", expires_at=9.0)[2] is None  # shared
    idx.check_integrity()


def test_pinned_host_only_blocks_are_never_evicted():
    idx = TierIndex(num_slots=1, block_bytes=B, pin_budget=B)
    lease, slots, _ = idx.reserve([1], 0.0, context_id="a", expires_at=9.0)
    idx.commit(lease, slots)
    assert idx.reserve([2], 0.0) == (0, [NO_SLOT], None)
    assert idx.expire(now=1.0, wall_now=10.0) == []  # expired: unpinned and freed
    assert not idx.contexts and len(idx.free) == 1
    idx.check_integrity()


def test_unpin_keeps_blocks_another_context_pins():
    idx = TierIndex(num_slots=3, block_bytes=B, pin_budget=3 * B)
    for ctx, hashes in (("a", [1, 2]), ("b", [1, 3])):
        lease, slots, _ = idx.reserve(hashes, 0.0, context_id=ctx, expires_at=9.0)
        idx.commit(lease, [s for s in slots if s != NO_SLOT])
    idx.unpin("a")
    assert set(idx.slot_of) == {1, 3} and set(idx.pins) == {1, 3}
    idx.check_integrity()


def test_disable_disk_forgets_disk_entries():
    idx = TierIndex(num_slots=1, block_bytes=B, disk_budget=4 * B)
    idx.add_disk(7, B)
    assert idx.lookup([7], 0.0)[1] == [ON_DISK]
    idx.release(max(idx.leases))
    assert idx.disable_disk() == [7]
    assert idx.lookup([7], 0.0) == (0, []) and idx.commit(0, []) == []
    idx.check_integrity()


def _fill_disk(idx, to_disk):
    for slot, h in to_disk:
        idx.disk_written(slot, h, B, ok=True)


def test_a_turn_pin_holds_host_slots_under_pressure_then_leaves_them_cached():
    """A context's pin lets a host copy go once the block is on disk; a turn
    pin (on_host) keeps it in host memory, and when it ends the blocks stay
    cached in the LRU: nothing is freed or deleted."""
    idx = TierIndex(num_slots=4, block_bytes=B, disk_budget=8 * B)
    _fill_disk(idx, write(idx, [1, 2], context_id="turn-a", expires_at=50.0, on_host=True)[1])
    for h in range(10, 16):  # other requests' blocks flood the host tier
        _fill_disk(idx, write(idx, [h])[1])
    assert {1, 2} <= set(idx.slot_of)  # held in host memory, though on disk too
    _, hits = idx.lookup([1, 2], 0.0)
    assert hits == [idx.slot_of[1], idx.slot_of[2]] and idx.host_pins.num_hits == 2
    idx.release(max(idx.leases))
    idx.lookup([1, 2], 0.0, count=False)  # a pin's own prefill: not a hit on a pinned turn
    assert idx.host_pins.num_hits == 2
    idx.release(max(idx.leases))
    assert idx.expire(now=1.0, wall_now=60.0) == []  # ended: no file deleted
    assert not idx.host_pins.pins and {1, 2} <= set(idx.slot_of) and {1, 2} <= set(idx.disk)
    _fill_disk(idx, write(idx, [20, 21, 22, 23])[1])  # now evictable as any block
    assert not {1, 2} & set(idx.slot_of) and idx.host_pins.num_hits == 2
    idx.check_integrity()


def test_turn_pins_take_at_most_half_the_host_slots():
    idx = TierIndex(num_slots=4, block_bytes=B)
    assert idx.reserve([1, 2], 0.0, context_id="turn-a", expires_at=9.0, on_host=True)[2] is None
    lease, slots, err = idx.reserve([3], 0.0, context_id="turn-b", expires_at=9.0, on_host=True)
    assert err == "over_budget" and idx.host_pins.num_refused == 1  # the boundary: 2 of 4
    assert idx.reserve([1], 0.0, context_id="turn-c", expires_at=9.0, on_host=True)[2] is None
    idx.unpin("turn-a")  # ContextUnpin of a turn pin: 1 stays held by turn-c, 2 is free
    assert idx.host_pins.holds(1) and not idx.host_pins.holds(2)
    idx.check_integrity()
