"""DualPath's DE -> PE layer stream in the masters' tier policy (staging.py on
the decode side, layered.py on the prefill side), with exact blocks."""

from __future__ import annotations

import pytest

from deepserve.engine.tiers.layered import with_stream
from deepserve.messages.cache import (DROP_STREAM, LOAD_LAYERS, ON_DISK, ON_STREAM,
                                      STAGE_STREAM, TierHits, TierRelease, TierReserve)
from deepserve.messages.pd import KVStream
from tests.engine.test_tiers_policy import GEOM, coordinator, done, seq


@pytest.fixture
def decode():
    kv, tiers = coordinator(tp=1)
    tiers.staging.stream_host = "10.0.0.1"  # its kv_bind_host: it serves layer streams
    yield kv, tiers
    kv.check_integrity()


def test_a_decode_task_for_another_host_stages_its_disk_blocks_into_a_stream(decode):
    kv, tiers = decode
    s = seq()
    lookup = tiers.stage(s, 0.0, "tcp://10.0.0.2:7001").sends[0]
    effects = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=5,
                                     slots=[5, ON_DISK, ON_DISK, 9], disk_dir="/d"), 0.1)
    [op] = effects.ops
    assert not [m for m in effects.sends if isinstance(m, TierReserve)]  # no host slots
    assert op.kind == STAGE_STREAM and op.seq_id == s.seq_id and op.disk_dir == "/d"
    assert op.hashes == lookup.hashes[1:3] and tiers.storage.num_blocks == 2
    effects = tiers.on_ops_done(done(op, num_ok=2, nbytes=128, stream="tcp://10.0.0.1:9"), 0.5)
    assert effects.staged == [s] and tiers.storage.num_blocks == 0
    assert s.kv_stream == KVStream(address="tcp://10.0.0.1:9", stream_id=s.seq_id,
                                   hashes=lookup.hashes[1:3])
    assert tiers.storage.bytes_read["decode"] == 128
    effects = tiers.unstage(s.seq_id)  # its KV arrived: the buffer and the lease go
    [drop] = effects.ops
    assert drop.kind == DROP_STREAM and drop.seq_id == s.seq_id
    assert effects.sends == [TierRelease(lease_id=5, model_key="m")]
    assert not tiers.unstage(s.seq_id).ops  # once


def test_a_stream_stage_cut_short_streams_what_it_read_and_an_empty_one_nothing(decode):
    kv, tiers = decode
    s, t = seq(), seq(seq_id=2, salt="u")
    for x in (s, t):
        lookup = tiers.stage(x, 0.0, "tcp://10.0.0.2:7001").sends[0]
        [op] = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, slots=[ON_DISK] * 4,
                                      disk_dir="/d"), 0.1).ops
        n = 1 if x is s else 0
        effects = tiers.on_ops_done(done(op, num_ok=n, error="gone", stream="tcp://a:1"), 0.2)
        assert effects.staged == [x]
    assert len(s.kv_stream.hashes) == 1 and t.kv_stream is None  # what it read: one block
    assert [o.kind for o in tiers.unstage(s.seq_id).ops] == [DROP_STREAM]
    assert not tiers.unstage(t.seq_id).ops  # nothing was put for it


def test_a_task_that_ends_while_its_stream_is_read_drops_the_stream(decode):
    kv, tiers = decode
    s = seq()
    lookup = tiers.stage(s, 0.0, "tcp://10.0.0.2:7001").sends[0]
    [op] = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, slots=[ON_DISK] * 4,
                                  disk_dir="/d"), 0.1).ops
    s.status = type(s.status).FINISHED
    effects = tiers.on_ops_done(done(op, num_ok=4, stream="tcp://a:1"), 0.2)
    assert not effects.staged and [o.kind for o in effects.ops] == [DROP_STREAM]


@pytest.mark.parametrize("stream_host, hop, prefill_from, streams", [
    ("10.0.0.1", "auto", "tcp://10.0.0.2:7001", True),
    ("10.0.0.1", "auto", "tcp://10.0.0.1:7001", False),  # this host: the host tier
    ("10.0.0.1", "auto", "ipc:///run/te1.pd.sock", False),
    ("10.0.0.1", "stream", "ipc:///run/te1.pd.sock", True),
    ("", "auto", "tcp://10.0.0.2:7001", False),  # no kv_stream_bytes: never
])
def test_which_prefill_te_gets_a_stream(stream_host, hop, prefill_from, streams):
    _, tiers = coordinator(tp=1)
    tiers.staging.stream_host, tiers.staging.hop = stream_host, hop
    assert tiers.staging.streams_to(prefill_from) is streams


def test_the_stream_takes_the_place_of_disk_hits_and_of_misses_past_them():
    stream = KVStream(address="a", stream_id=1, hashes=[12, 13, 14])
    assert with_stream(None, [11, 12], [5, ON_DISK]) == [5, ON_DISK]
    assert with_stream(stream, [11, 12, 13, 14, 15], [5, ON_DISK]) == [5] + [ON_STREAM] * 3
    assert with_stream(stream, [12, 11, 13], [7, ON_DISK]) == [7, ON_DISK, ON_STREAM]
    assert with_stream(stream, [11, 12], []) == []  # the run ends at a block neither holds


@pytest.mark.parametrize("layers", [0, 2])
def test_a_prefill_task_pulls_its_stream_layer_by_layer(layers):
    kv, tiers = coordinator(tp=1)
    tiers.layered.layers = layers
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    s.kv_stream = KVStream(address="tcp://10.0.0.1:9", stream_id=70, hashes=lookup.hashes[1:])
    effects = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, lease_id=3, slots=[5],
                                     segment="seg", disk_dir="/d"), 0.1)
    [op] = effects.ops
    assert op.kind == LOAD_LAYERS and op.slots == [5, ON_STREAM, ON_STREAM, ON_STREAM]
    assert (op.stream, op.stream_id, op.stream_rows) == ("tcp://10.0.0.1:9", 70, [0, 1, 2])
    assert op.layers == (layers or GEOM.num_layers) and tiers.storage.num_blocks == 0
    assert len(kv.block_table(s.seq_id)) == 5  # its own blocks, the whole prompt
    effects = tiers.on_ops_done(done(op), 0.3)
    assert effects.ready == [s] and s.preloaded_tokens == 16
    assert (s.tier_tokens["host"], s.tier_tokens["stream"]) == (4, 12)
    assert tiers.hit_tokens["stream"] == 12 and tiers.lookups_by_outcome["fetch_layers"] == 1
    kv.check_integrity()


def test_a_prefill_te_of_tp_2_ignores_the_stream():
    kv, tiers = coordinator(tp=2)
    s = seq()
    lookup = tiers.admit(s, 0.0).sends[0]
    s.kv_stream = KVStream(address="a", stream_id=1, hashes=lookup.hashes)
    effects = tiers.on_hits(TierHits(lookup_id=lookup.lookup_id, slots=[]), 0.1)
    assert effects.ready == [s] and not effects.ops
