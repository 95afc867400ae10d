"""Layered KV loads (worker/layer_loads.py) on real block files and a real pool:
the first layers before the forward, the rest during it, a ring of `layers`
layers, and every failure either trimmed at the prime or reported as lost."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from deepserve.messages.cache import LOAD_LAYERS, ON_DISK, BlockGeometry, CacheOp
from deepserve.tiers import block_file as bf
from deepserve.tiers.token_bucket import TokenBucket
from deepserve.worker.cache_executor import host_to_pool
from deepserve.worker.layer_loads import LAYER_TIMEOUT_S, LayerLoads

L, H, BS, D, NB = 6, 2, 4, 8, 16
GEOM = BlockGeometry(num_layers=L, num_kv_heads=H, block_size=BS, head_dim=D, dtype="float32")


def block(seed: int) -> torch.Tensor:
    """A block as stored: (2, L, H, bs, D), values naming the seed."""
    return torch.arange(2 * L * H * BS * D, dtype=torch.float32).view(2, L, H, BS, D) + seed * 1e4


def write(tmp_path, hashes) -> None:
    for h in hashes:
        bf.write_block(tmp_path, h, GEOM, block(h).numpy().tobytes())


def rig(tmp_path, rate=None, host=None):
    """A pool and its LayerLoads; host: the host tier's slots, copied as the
    cache executor copies them."""
    pool = torch.zeros(2, L, H, NB, BS, D)
    return pool, LayerLoads(pool, GEOM, TokenBucket(rate), lambda op: host_to_pool(
        pool, host, op.slots, op.block_ids, 0, H))


def seqs(*seq_ids):
    """A forward's scheduled sequences (only their ids matter here)."""
    return [SimpleNamespace(seq_id=i) for i in seq_ids]


def consume(loads, seq_ids=(7,)):
    """One forward of these sequences: every layer's hook, then its end."""
    fwd = loads.forward(seqs(*seq_ids))
    for j in range(L):
        fwd.before_layer(j)
    return fwd.end()


@pytest.mark.parametrize("layers", [1, 2, 4, L, L + 3])
def test_every_layer_lands_in_the_pool_through_a_ring_of_that_many(tmp_path, layers):
    write(tmp_path, [11, 12, 13])
    pool, loads = rig(tmp_path)
    load = loads.open(CacheOp(1, LOAD_LAYERS, [5, 9, 2], slots=[ON_DISK] * 3,
                              hashes=[11, 12, 13], disk_dir=str(tmp_path), seq_id=7,
                              layers=layers))
    assert load.prime() == 3 and load.prime_error is None
    assert load.read == min(layers, L) and not pool.any()  # primed: nothing in the pool yet
    assert load.staged_bytes == min(layers, L) * 2 * 3 * H * BS * D * 4  # the ring, no more
    assert consume(loads) == []
    for b, h in ((5, 11), (9, 12), (2, 13)):
        assert torch.equal(pool[:, :, :, b], block(h))
    assert pool[:, :, :, [0, 1, 3]].abs().sum() == 0  # no other block touched
    assert loads.loads == {}  # consumed: off the book


def test_the_reads_of_later_layers_overlap_the_forward(tmp_path):
    """With a ring of 1 and a slow bucket, layer j+1 is read while layer j
    computes: the forward waits for each, and the ring holds one layer."""
    write(tmp_path, [1, 2])
    layer_bytes = 2 * bf.layer_nbytes(GEOM) * 2
    pool, loads = rig(tmp_path, rate=layer_bytes / 0.05)  # 50 ms a layer
    load = loads.open(CacheOp(1, LOAD_LAYERS, [0, 1], slots=[ON_DISK] * 2, hashes=[1, 2],
                              disk_dir=str(tmp_path), seq_id=7, layers=1))
    assert load.prime() == 2 and load.read == 1
    fwd = loads.forward(seqs(7))
    started = time.monotonic()
    for j in range(L):
        fwd.before_layer(j)
        assert fwd.loads[0].read <= j + 2  # never more than one layer ahead of the pool
        time.sleep(0.05)  # layer j "computes" while j+1 is read
    assert fwd.end() == []
    assert time.monotonic() - started < (L + L - 1) * 0.05  # overlapped, not serial
    assert torch.equal(pool[:, :, :, 0], block(1)) and torch.equal(pool[:, :, :, 1], block(2))


def test_host_hits_are_copied_whole_at_the_prime(tmp_path):
    write(tmp_path, [3])
    host = torch.stack([block(100), block(101)])  # two host slots
    pool, loads = rig(tmp_path, host=host)
    load = loads.open(CacheOp(1, LOAD_LAYERS, [4, 6], slots=[1, ON_DISK], hashes=[0, 3],
                              disk_dir=str(tmp_path), segment="s", seq_id=7, layers=2))
    assert load.prime() == 2
    assert torch.equal(pool[:, :, :, 4], block(101))  # before any forward
    assert consume(loads) == []
    assert torch.equal(pool[:, :, :, 6], block(3))


@pytest.mark.parametrize("damage", ["missing", "header", "v1", "layer0"])
def test_a_block_that_fails_at_the_prime_ends_the_load_before_it(tmp_path, damage):
    write(tmp_path, [1, 2, 3])
    path = bf.block_path(tmp_path, 2)
    data = bytearray(path.read_bytes())
    if damage == "missing":
        path.unlink()
    elif damage == "header":
        data[0] ^= 1
    elif damage == "v1":  # written before the trailer: whole reads only
        data[:8] = bf.MAGIC_V1
    else:
        data[bf.HEADER_BYTES + 3] ^= 0x40  # layer 0's K, read at the prime
    if damage != "missing":
        path.write_bytes(bytes(data))
    pool, loads = rig(tmp_path)
    load = loads.open(CacheOp(1, LOAD_LAYERS, [0, 1, 2], slots=[ON_DISK] * 3, hashes=[1, 2, 3],
                              disk_dir=str(tmp_path), seq_id=7, layers=1))
    assert load.prime() == 1 and load.prime_error
    assert load.corrupt == ([2] if damage in ("header", "layer0") else [])
    assert consume(loads) == []  # what it kept is whole: nothing lost
    assert torch.equal(pool[:, :, :, 0], block(1)) and pool[:, :, :, 1:3].abs().sum() == 0


def test_a_layer_that_fails_inside_the_forward_is_lost_with_its_file(tmp_path):
    write(tmp_path, [1, 2])
    path = bf.block_path(tmp_path, 2)
    data = bytearray(path.read_bytes())
    data[bf.HEADER_BYTES + 4 * bf.layer_nbytes(GEOM) + 5] ^= 0x40  # layer 4's K slice
    path.write_bytes(bytes(data))
    pool, loads = rig(tmp_path)
    load = loads.open(CacheOp(1, LOAD_LAYERS, [0, 1], slots=[ON_DISK] * 2, hashes=[1, 2],
                              disk_dir=str(tmp_path), seq_id=7, layers=2))
    assert load.prime() == 2 and load.prime_error is None  # layers 0-1 read clean
    [lost] = consume(loads)
    assert lost.seq_id == 7 and lost.corrupt == [2] and "layer 4" in lost.message
    assert torch.equal(pool[:, :4, :, 0], block(1)[:, :4])  # up to the failure
    assert pool[:, 4:].abs().sum() == 0  # nothing past it was copied


def test_a_file_removed_after_the_prime_is_still_read(tmp_path):
    write(tmp_path, [1])
    pool, loads = rig(tmp_path)
    load = loads.open(CacheOp(1, LOAD_LAYERS, [3], slots=[ON_DISK], hashes=[1],
                              disk_dir=str(tmp_path), seq_id=7, layers=1))
    assert load.prime() == 1
    bf.block_path(tmp_path, 1).unlink()  # evicted by the disk tier meanwhile
    assert consume(loads) == []
    assert torch.equal(pool[:, :, :, 3], block(1))


def test_dropped_and_other_sequences_loads_are_not_consumed(tmp_path):
    write(tmp_path, [1, 2])
    pool, loads = rig(tmp_path)
    a = loads.open(CacheOp(1, LOAD_LAYERS, [0], slots=[ON_DISK], hashes=[1],
                           disk_dir=str(tmp_path), seq_id=7, layers=1))
    b = loads.open(CacheOp(2, LOAD_LAYERS, [1], slots=[ON_DISK], hashes=[2],
                           disk_dir=str(tmp_path), seq_id=8, layers=1))
    a.prime(), b.prime()
    assert loads.forward(seqs(99)) is None  # a forward of other sequences takes none
    loads.drop(7)  # the request ended, or the master gave up on the load
    assert loads.forward(seqs(7)) is None and a.closed
    assert consume(loads, seq_ids=(8,)) == []
    assert pool[:, :, :, 0].abs().sum() == 0 and torch.equal(pool[:, :, :, 1], block(2))


def test_closing_mid_forward_stops_the_reader(tmp_path):
    write(tmp_path, [1])
    pool, loads = rig(tmp_path, rate=bf.layer_nbytes(GEOM) * 2 / 0.2)  # 200 ms a layer
    load = loads.open(CacheOp(1, LOAD_LAYERS, [0], slots=[ON_DISK], hashes=[1],
                              disk_dir=str(tmp_path), seq_id=7, layers=1))
    load.prime()
    fwd = loads.forward(seqs(7))
    fwd.before_layer(0)
    fwd.end()  # the forward failed after layer 0 (a worker error): the load goes
    assert load.reader is None or not load.reader.is_alive()
    assert all(f.fd == -1 for f in load.files)
    assert threading.active_count() < 50


def test_a_load_dropped_before_or_while_priming_reads_nothing_and_leaves_no_file_open(tmp_path):
    write(tmp_path, [1, 2])
    pool, loads = rig(tmp_path)
    early = loads.open(CacheOp(1, LOAD_LAYERS, [0], slots=[ON_DISK], hashes=[1],
                               disk_dir=str(tmp_path), seq_id=7, layers=1))
    loads.drop(7)  # before the storage thread got to it
    assert early.prime() == 0 and early.files == []
    late = loads.open(CacheOp(2, LOAD_LAYERS, [1], slots=[ON_DISK], hashes=[2],
                              disk_dir=str(tmp_path), seq_id=8, layers=1))
    late._open()  # priming: its files are open
    opened = list(late.files)
    loads.drop(8)  # the master gave up on it meanwhile: the files stay for the prime
    assert opened and all(f.fd >= 0 for f in opened)
    late.prime()  # the rest of its prime sees it dropped and closes them
    assert all(f.fd == -1 for f in opened)
    assert pool.abs().sum() == 0


def test_a_forward_waiting_on_a_layer_beats_and_its_timeout_scales_with_the_bucket(tmp_path):
    """A wait on storage is progress (the worker beats, num_waits counts it),
    bounded by the layer's timeout: LAYER_TIMEOUT_S, or 4x the layer's time
    at the bucket's rate when that is longer; past it the load is lost."""
    write(tmp_path, [1])
    layer_bytes = 2 * bf.layer_nbytes(GEOM)
    pool, loads = rig(tmp_path, rate=layer_bytes / 1.2)  # 1.2 s a layer
    beats = []
    loads.beat = lambda: beats.append(time.monotonic())
    load = loads.open(CacheOp(1, LOAD_LAYERS, [0], slots=[ON_DISK], hashes=[1],
                              disk_dir=str(tmp_path), seq_id=7, layers=1))
    assert load.layer_timeout_s == max(LAYER_TIMEOUT_S, 4 * 1.2)
    load.prime()
    fwd = loads.forward(seqs(7))
    fwd.before_layer(0)
    fwd.before_layer(1)  # read during the forward: about 1.2 s of waiting
    assert len(beats) >= 1 and loads.num_waits == len(beats)
    fwd.end()
    slow, loads2 = rig(tmp_path, rate=layer_bytes / 5.0)
    assert loads2.open(CacheOp(2, LOAD_LAYERS, [0], slots=[ON_DISK], hashes=[1],
                               disk_dir=str(tmp_path), seq_id=8, layers=1)
                       ).layer_timeout_s == pytest.approx(20.0)
    loads2.close()
