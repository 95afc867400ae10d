"""The tier service over real sockets: leases, write-through to disk, context
pins whose blocks all go when they expire (a soak ends where it began)."""

import time

import numpy as np
import pytest
import zmq

from deepserve.ipc.sockets import PullSocket, PushSocket, ipc_address
from deepserve.messages.cache import (NO_SLOT, ON_DISK, BlockGeometry, ContextUnpin, FromTier,
                                      TierCommit, TierCommitted, TierLookup, TierReserve)
from deepserve.tiers import block_file

GEOM = BlockGeometry(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32")
NBYTES = block_file.block_nbytes(GEOM)


@pytest.fixture
def rig(tier_service, short_dir):
    service = tier_service(host_bytes=8 * NBYTES, disk_bytes=32 * NBYTES + 64 * 32,
                           scrub_bytes_per_s=4 << 20)
    ctx = zmq.Context()
    reply = ipc_address(short_dir, "me")
    out = PushSocket(ctx, service.address, bind=False)
    back = PullSocket(ctx, reply, bind=True, type=FromTier)
    yield service, out, back, reply
    out.close()
    back.close()
    ctx.term()


def write(service, out, back, reply, hashes, **pin):
    out.put(TierReserve(reserve_id=1, model_key="m", geometry=GEOM, hashes=hashes,
                        reply_to=reply, **pin))
    reserved = back.get(timeout=5)
    slots = [s for s in reserved.slots if s != NO_SLOT]
    pool = service.call(lambda s: s.pools["m"].slots)
    for s in slots:  # what a worker's store_host does
        pool[s] = np.full(NBYTES, s % 250, dtype=np.uint8)
    out.put(TierCommit(lease_id=reserved.lease_id, model_key="m", slots=slots, reply_to=reply,
                       reserve_id=1))
    assert isinstance(back.get(timeout=5), TierCommitted)
    return reserved


def counts(service):
    def read(s):
        p = s.pools["m"].index
        p.check_integrity()
        return len(p.slot_of), len(p.disk), len(p.pins), len(p.leases)
    return service.call(read)


def test_blocks_reach_disk_and_come_back_from_it(rig, tmp_path):
    service, out, back, reply = rig
    reserved = write(service, out, back, reply, list(range(10, 20)))  # 8 host slots
    assert reserved.slots[8:] == [NO_SLOT, NO_SLOT]  # all 8 were being written: no room
    deadline = time.monotonic() + 5
    while counts(service)[1] < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    write(service, out, back, reply, [18, 19])  # the oldest two leave the host (on disk)
    while counts(service)[1] < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts(service)[:2] == (8, 10)
    out.put(TierLookup(lookup_id=2, model_key="m", geometry=GEOM, hashes=list(range(10, 20)),
                       reply_to=reply))
    hits = back.get(timeout=5)
    assert hits.slots.count(ON_DISK) == 2 and len(hits.slots) == 10
    disk_dir = hits.disk_dir
    assert hits.slots[:2] == [ON_DISK, ON_DISK]  # 10 and 11 went: the oldest
    first = block_file.read_block(disk_dir, 10, GEOM)  # whole, as the worker wrote it
    assert bytes(first) == bytes([0]) * NBYTES


def test_a_staging_reserve_over_the_wire_gets_what_the_tier_can_hold(rig):
    """TierReserve(hold=True), as a decode TE stages for its prefill TE: an
    8-slot host tier gives slots to 4 blocks (half), NO_SLOT to the other 2."""
    service, out, back, reply = rig
    out.put(TierReserve(reserve_id=1, model_key="m", geometry=GEOM, hashes=list(range(30, 36)),
                        reply_to=reply, hold=True))
    reserved = back.get(timeout=5)
    assert [s == NO_SLOT for s in reserved.slots] == [False] * 4 + [True] * 2
    assert service.call(lambda s: s.pools["m"].index.holds_cut) == 2


def test_context_soak_ends_where_it_began(rig):
    service, out, back, reply = rig
    write(service, out, back, reply, [1, 2])  # ordinary cache, not pinned
    time.sleep(0.3)
    baseline = counts(service)
    for cycle in range(20):
        ctx_id = f"ctx-{cycle}"
        write(service, out, back, reply, [100, 101, 102], context_id=ctx_id,
              expires_at=time.time() + (0.05 if cycle % 2 else 60))
        if cycle % 2 == 0:
            out.put(ContextUnpin(context_id=ctx_id))  # deleted; the odd ones expire
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and counts(service) != baseline:
            time.sleep(0.05)
        assert counts(service) == baseline, f"cycle {cycle}: {counts(service)} != {baseline}"


def _until(fn, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := fn()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_a_full_disk_turns_the_tier_off_and_a_probe_turns_it_back_on(rig):
    """Before: the first failed write turned the disk tier off until the
    service restarted. Now a block-sized probe write every probe_s brings it
    back once the disk has room, and the files written before are found again."""
    service, out, back, reply = rig
    service.call(lambda s: setattr(s.upkeep, "probe_s", 0.2))
    write(service, out, back, reply, [1, 2, 3])
    assert _until(lambda: counts(service)[1] == 3)
    service.call(lambda s: setattr(s, "_drill_disk_full", True))  # the fault: ENOSPC
    write(service, out, back, reply, [4])
    assert _until(lambda: not service.call(lambda s: s.disk_enabled))
    assert counts(service)[1] == 0 and service.call(lambda s: s.report().disk_capacity) == 0
    time.sleep(0.6)  # probes fail while the disk is full
    assert not service.call(lambda s: s.disk_enabled)
    service.call(lambda s: setattr(s, "_drill_disk_full", False))  # room again
    assert _until(lambda: service.call(lambda s: s.disk_enabled))
    assert counts(service)[1] == 3  # 1-3 found on disk again; 4 was never written
    write(service, out, back, reply, [5])
    assert _until(lambda: counts(service)[1] == 4)


def test_the_scrub_drops_and_deletes_a_corrupt_block_file_before_a_te_reads_it(rig):
    service, out, back, reply = rig
    write(service, out, back, reply, [21, 22, 23])
    assert _until(lambda: counts(service)[1] == 3)
    disk_dir = service.call(lambda s: s.pools["m"].disk_dir)
    path = block_file.block_path(disk_dir, 22)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x55  # the fault: one payload byte flipped on disk
    path.write_bytes(bytes(data))
    assert _until(lambda: service.call(lambda s: s.num_corrupt) == 1)
    assert not path.exists() and counts(service)[1] == 2
    assert all(block_file.block_path(disk_dir, h).exists() for h in (21, 23))
    assert service.call(lambda s: sorted(s.pools["m"].index.disk)) == [21, 23]
