"""A prefill TE's read-ahead (engine/tiers/staging.py: read_ahead): a request
waiting for room in the pool has its disk hits read into the TE's own buffer
meanwhile, and its layered load reads them there once it has room. The
masters' tier policy with exact blocks, no processes."""

from __future__ import annotations

import pytest

from deepserve.messages.cache import (DROP_STREAM, LOAD_LAYERS, ON_DISK, ON_STREAM,
                                      STAGE_STREAM, TierHits, TierLookup)
from tests.engine.test_tiers_policy import _fill, coordinator, done, seq

BUFFER = "tcp://127.0.0.1:9"  # where the worker serves its buffer (CacheOpsDone.stream)
HITS = [5, ON_DISK, ON_DISK, ON_DISK]  # one host hit, three on disk
HOG = 99  # the sequence that fills the pool (_fill)


@pytest.fixture
def prefill():
    kv, tiers = coordinator(tp=1)
    tiers.layered.layers = 2
    tiers.staging.stream_host = "127.0.0.1"  # kv_stream_bytes > 0: it has a buffer
    yield kv, tiers
    kv.check_integrity()


def waiting(kv, tiers):
    """A request looked up with no room for it (HOG leaves 2 free blocks, it
    needs 5): (the request, its lookup, the effects)."""
    assert _fill(kv, keep_free=2) == HOG
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    return s, lookup, tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=7,
                                             slots=HITS, segment="seg", disk_dir="/d"), 0.1)


def test_a_request_waiting_for_room_has_its_disk_hits_read_ahead_and_then_read_in_place(
        prefill):
    kv, tiers = prefill
    s, lookup, effects = waiting(kv, tiers)
    [op] = effects.ops
    assert op.kind == STAGE_STREAM and op.hashes == lookup.hashes[1:] and op.seq_id == s.seq_id
    assert not effects.ready and tiers.waiting
    assert tiers.lookups_by_outcome == {"no_room_read_ahead": 1}
    assert tiers.read_queue_blocks == tiers.storage.num_blocks == 3  # counted once
    kv.free(HOG)
    assert not tiers.poll(0.2).sends  # room, but its reads are under way: it waits for them
    tiers.on_ops_done(done(op, num_ok=3, nbytes=96, stream=BUFFER), 0.3)
    assert s.kv_stream.hashes == lookup.hashes[1:] and s.kv_stream.stream_id == s.seq_id
    assert tiers.storage.bytes_read == {"prefill": 96, "decode": 0} and tiers.read_queue_blocks == 0
    [again] = tiers.poll(0.4).sends
    assert isinstance(again, TierLookup) and again.hashes == lookup.hashes
    [load] = tiers.on_hits(TierHits(lookup_id=again.lookup_id, lease_id=8, slots=HITS,
                                    segment="seg", disk_dir="/d"), 0.5).ops
    assert load.kind == LOAD_LAYERS and load.slots == [5] + [ON_STREAM] * 3
    assert (load.stream, load.stream_id, load.stream_rows) == (BUFFER, s.seq_id, [0, 1, 2])
    assert tiers.storage.num_blocks == 0  # nothing read from storage twice
    assert tiers.on_ops_done(done(load), 0.6).ready == [s]
    assert s.tier_tokens == {"host": 4, "disk": 12}  # storage hits, read early: tier disk
    assert tiers.hit_tokens["stream"] == 0
    assert not tiers.unstage(s.seq_id).ops  # the worker drops it after the forward reads it
    kv.free(s.seq_id)


def test_without_a_buffer_a_waiting_request_reads_nothing_ahead(prefill):
    kv, tiers = prefill
    tiers.staging.stream_host = ""  # kv_stream_bytes = 0
    _, _, effects = waiting(kv, tiers)
    assert not effects.ops and tiers.lookups_by_outcome == {"no_room": 1}
    assert tiers.storage.num_blocks == 0 and tiers.read_queue_blocks == 3  # read once in room
    kv.free(HOG)


def test_a_read_ahead_that_got_nothing_leaves_the_reads_to_the_layered_load(prefill):
    kv, tiers = prefill
    s, _, effects = waiting(kv, tiers)
    tiers.on_ops_done(done(effects.ops[0], num_ok=0, error="stream buffer full"), 0.2)
    assert s.kv_stream is None and not tiers.staging.reading_ahead
    kv.free(HOG)
    again = tiers.poll(0.3).sends[0]
    [load] = tiers.on_hits(TierHits(lookup_id=again.lookup_id, lease_id=8, slots=HITS,
                                    segment="seg", disk_dir="/d"), 0.4).ops
    assert load.slots == HITS and tiers.storage.num_blocks == 3  # from storage, as before
    tiers.on_ops_done(done(load), 0.5)
    kv.free(s.seq_id)


def test_a_read_ahead_not_used_is_dropped(prefill):
    """Waited past the deadline: computed, and its buffer let go at once."""
    kv, tiers = prefill
    s, _, effects = waiting(kv, tiers)
    tiers.on_ops_done(done(effects.ops[0], num_ok=3, stream=BUFFER), 0.2)
    effects = tiers.poll(tiers.channel.op_timeout_s + 1)
    assert effects.ready == [s] and tiers.lookups_by_outcome["room_timeout"] == 1
    [drop] = effects.ops
    assert drop.kind == DROP_STREAM and drop.seq_id == s.seq_id and s.kv_stream is None
    kv.free(HOG)


def test_a_request_that_ends_while_its_hits_are_read_ahead_drops_them(prefill):
    kv, tiers = prefill
    s, _, effects = waiting(kv, tiers)
    s.status = type(s.status).FINISHED  # aborted meanwhile
    effects = tiers.on_ops_done(done(effects.ops[0], num_ok=3, stream=BUFFER), 0.2)
    assert [o.kind for o in effects.ops] == [DROP_STREAM] and not effects.ready
    assert not tiers.poll(0.3).ready and not tiers.has_work
    kv.free(HOG)


def test_a_request_that_stops_waiting_while_its_hits_are_read_ahead_drops_them_when_read(
        prefill):
    """Its wait ends (the room deadline) before the read-ahead does: computed
    now, and what the read-ahead brings is dropped when it comes."""
    kv, tiers = prefill
    tiers.storage.rate = 1.0  # bytes/s: the read's own deadline is far off
    s, _, effects = waiting(kv, tiers)
    late = tiers.poll(tiers.channel.op_timeout_s + 0.2)  # past the room deadline only
    assert late.ready == [s] and not late.ops and tiers.lookups_by_outcome["room_timeout"] == 1
    effects = tiers.on_ops_done(done(effects.ops[0], num_ok=3, stream=BUFFER), 5.0)
    assert [o.kind for o in effects.ops] == [DROP_STREAM] and not effects.ready
    assert s.kv_stream is None and not tiers.staging.streamed and not tiers.staging.ahead
    assert not tiers.has_work
    kv.free(HOG)
