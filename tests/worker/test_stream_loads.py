"""DualPath's DE -> PE hop at the workers: a decode-side cache executor reads
block files into a layer stream (stage_stream), a prefill-side one pulls it a
layer at a time into its pool (load_layers with ON_STREAM rows), over real
tcp on loopback. Real block files, real pools, real sockets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import zmq

from deepserve.messages.cache import (DROP_STREAM, LOAD_LAYERS, ON_DISK, ON_STREAM,
                                      STAGE_STREAM, BlockGeometry, CacheOp)
from deepserve.tiers import block_file as bf
from deepserve.worker.cache_executor import CacheExecutor

L, H, NB, BS, D = 4, 2, 8, 4, 8


def block(seed: int) -> torch.Tensor:
    return torch.arange(2 * L * H * BS * D, dtype=torch.float32).view(2, L, H, BS, D) + seed * 1e4


@pytest.fixture
def pair(tmp_path):
    """(decode executor serving streams, its disk dir, prefill executor, its disk dir)."""
    ctx = zmq.Context()
    de = CacheExecutor(torch.zeros(2, L, H, NB, BS, D), 0, 1, ctx, "inproc://unused",
                       stream=("tcp://127.0.0.1:0", 3 * bf.block_nbytes(_geom()), 30.0))
    pe = CacheExecutor(torch.zeros(2, L, H, NB, BS, D), 0, 1, ctx, "inproc://unused")
    (tmp_path / "de").mkdir()
    (tmp_path / "pe").mkdir()
    yield de, tmp_path / "de", pe, tmp_path / "pe"
    pe.close()
    de.close()
    ctx.term()


def _geom() -> BlockGeometry:
    return BlockGeometry(num_layers=L, num_kv_heads=H, block_size=BS, head_dim=D,
                         dtype="float32")


def write(disk, hashes) -> None:
    for h in hashes:
        bf.write_block(disk, h, _geom(), block(h).numpy().tobytes())


def forward(ex, seq_id=7):
    fwd = ex.layers.forward([SimpleNamespace(seq_id=seq_id)])
    for j in range(L):
        fwd.before_layer(j)
    return fwd.end()


def load_op(done, rows, slots, hashes, pe_disk, layers=1):
    return CacheOp(2, LOAD_LAYERS, list(range(len(slots))), slots=slots, hashes=hashes,
                   disk_dir=str(pe_disk), seq_id=7, layers=layers, stream=done.stream,
                   stream_id=70, stream_rows=rows)


def test_staged_blocks_reach_the_prefill_pool_a_layer_at_a_time(pair):
    de, de_disk, pe, pe_disk = pair
    write(de_disk, [11, 13])
    write(pe_disk, [12])  # the prefill TE's own disk hit, between the two streamed
    done = de.run(CacheOp(1, STAGE_STREAM, [], hashes=[11, 13], disk_dir=str(de_disk),
                          seq_id=70))
    assert (done.num_ok, done.error) == (2, None) and done.stream == de.streams.address
    assert done.nbytes == 2 * bf.block_nbytes(_geom())  # read through the DE's bucket
    op = load_op(done, [0, 1], [ON_STREAM, ON_DISK, ON_STREAM], [0, 12, 0], pe_disk)
    primed = pe.layers.open(op).prime()
    assert primed == 3 and de.streams.num_pulls == 1  # layer 0, before the forward
    assert not pe.pool.any()
    assert forward(pe) == []
    for b, h in ((0, 11), (1, 12), (2, 13)):
        assert torch.equal(pe.pool[:, :, :, b], block(h))
    assert de.streams.num_pulls == L  # one pull a layer, for both stream rows


def test_a_read_ahead_into_its_own_buffer_is_read_in_place_and_dropped_after_the_forward(
        pair):
    """A prefill TE's read-ahead (its PE buffer): the same worker stages and
    loads, with no pull over its socket; the forward that read it drops it."""
    de, de_disk, _, _ = pair  # the executor with a buffer, as a prefill TE's here
    write(de_disk, [11, 13])
    done = de.run(CacheOp(1, STAGE_STREAM, [], hashes=[11, 13], disk_dir=str(de_disk),
                          seq_id=7))
    assert done.num_ok == 2 and done.stream == de.streams.address
    op = CacheOp(2, LOAD_LAYERS, [3, 5], slots=[ON_STREAM, ON_STREAM], hashes=[0, 0],
                 disk_dir=str(de_disk), seq_id=7, layers=1, stream=done.stream, stream_id=7,
                 stream_rows=[0, 1])
    assert de.layers.open(op).prime() == 2
    assert forward(de) == []
    for b, h in ((3, 11), (5, 13)):
        assert torch.equal(de.pool[:, :, :, b], block(h))
    assert de.streams.num_pulls == 0  # in place: nothing went over tcp
    assert de.streams.held_bytes == 0  # consumed by its forward: the buffer is free again


def test_a_stage_stops_at_a_bad_file_and_at_a_full_buffer(pair):
    de, de_disk, _, _ = pair
    write(de_disk, [1, 2, 3, 4, 5])
    path = bf.block_path(de_disk, 2)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    bad = de.run(CacheOp(1, STAGE_STREAM, [], hashes=[1, 2, 3], disk_dir=str(de_disk),
                         seq_id=1))
    assert (bad.num_ok, bad.corrupt) == (1, [2]) and "corrupt" in bad.error
    full = de.run(CacheOp(2, STAGE_STREAM, [], hashes=[3, 4, 5], disk_dir=str(de_disk),
                          seq_id=2))  # room for 3 blocks, stream 1 holds one
    assert full.num_ok == 2 and "buffer full" in full.error
    de.submit([CacheOp(3, DROP_STREAM, [], seq_id=1)])
    assert de.streams.held_bytes == 2 * bf.block_nbytes(_geom())


def test_a_stream_gone_before_the_prime_ends_the_load_before_its_first_block(pair):
    de, de_disk, pe, pe_disk = pair
    write(de_disk, [11])
    write(pe_disk, [12])
    done = de.run(CacheOp(1, STAGE_STREAM, [], hashes=[11], disk_dir=str(de_disk), seq_id=70))
    de.submit([CacheOp(9, DROP_STREAM, [], seq_id=70)])
    load = pe.layers.open(load_op(done, [0], [ON_DISK, ON_STREAM], [12, 0], pe_disk))
    assert load.prime() == 1 and "no stream 70" in load.prime_error
    assert forward(pe) == []  # the disk block it kept lands; the other is computed
    assert torch.equal(pe.pool[:, :, :, 0], block(12)) and not pe.pool[:, :, :, 1].any()


def test_a_stream_lost_inside_the_forward_loses_the_load_without_blaming_a_file(pair):
    de, de_disk, pe, pe_disk = pair
    write(de_disk, [11, 13])
    done = de.run(CacheOp(1, STAGE_STREAM, [], hashes=[11, 13], disk_dir=str(de_disk),
                          seq_id=70))
    load = pe.layers.open(load_op(done, [0, 1], [ON_STREAM, ON_STREAM], [0, 0], pe_disk))
    assert load.prime() == 2
    de.streams.drop(70)  # the decode TE let it go (or died) after the prime
    [lost] = forward(pe)
    assert lost.seq_id == 7 and lost.corrupt == [] and "no stream 70" in lost.message
    assert torch.equal(pe.pool[:, 0, :, 0], block(11)[:, 0])  # layer 0 came before
    assert not pe.pool[:, 1:].any()  # nothing past the failure


def test_a_layered_load_with_stream_rows_needs_one_row_each(pair):
    _, _, pe, pe_disk = pair
    bad = CacheOp(2, LOAD_LAYERS, [0, 1], slots=[ON_STREAM, ON_STREAM], hashes=[0, 0],
                  disk_dir=str(pe_disk), seq_id=7, layers=1, stream="tcp://127.0.0.1:1",
                  stream_id=1, stream_rows=[0])
    done = pe.run(bad)
    assert done.num_ok == 0 and "stream rows" in done.error


def test_a_worker_without_streams_refuses_stage_stream(pair):
    _, _, pe, pe_disk = pair
    done = pe.run(CacheOp(1, STAGE_STREAM, [], hashes=[1], disk_dir=str(pe_disk), seq_id=1))
    assert done.num_ok == 0 and "no layer streams" in done.error and done.stream == ""
