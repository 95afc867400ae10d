"""The worker's cache executor, op by op, on a real pool and a real host segment."""

import uuid

import pytest
import torch
import zmq

from deepserve.ipc.segments import create_segment, unlink_segment
from deepserve.messages.cache import LOAD_DISK, LOAD_HOST, STAGE_DISK, STORE_HOST, CacheOp
from deepserve.tiers import block_file
from deepserve.worker.cache_executor import CacheExecutor

L, H, NB, BS, D = 2, 2, 8, 4, 8  # pool (2, L, H, NB, BS, D), float32


@pytest.fixture
def rig(tmp_path):
    ctx = zmq.Context()
    pool = torch.randn(2, L, H, NB, BS, D)
    ex = CacheExecutor(pool, rank=0, tp=1, ctx=ctx, done_address="inproc://unused")
    name = f"deepserve-test{uuid.uuid4().hex[:8]}-kvh"
    nbytes = block_file.block_nbytes(ex.geometry)
    shm = create_segment(name, 4 * nbytes)
    yield ex, pool, name, tmp_path
    ex.close()
    shm.close()
    unlink_segment(name)
    ctx.term()


def test_store_then_load_host_round_trips_blocks(rig):
    ex, pool, seg, _ = rig
    want = pool[:, :, :, [1, 5]].clone()
    done = ex.run(CacheOp(1, STORE_HOST, [1, 5], slots=[3, 0], segment=seg))
    assert (done.num_ok, done.error) == (2, None)
    pool[:, :, :, [6, 7]] = 0
    done = ex.run(CacheOp(2, LOAD_HOST, [6, 7], slots=[3, 0], segment=seg))
    assert done.num_ok == 2 and torch.equal(pool[:, :, :, [6, 7]], want)


def test_disk_loads_and_stages_stop_at_a_bad_file(rig):
    ex, pool, seg, disk = rig
    blocks = [torch.randn(2, L, H, BS, D) for _ in range(3)]
    for h, b in zip((11, 12, 13), blocks):
        block_file.write_block(disk, h, ex.geometry, b.numpy().tobytes())
    path = block_file.block_path(disk, 12)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    done = ex.run(CacheOp(3, LOAD_DISK, [0, 1, 2], hashes=[11, 12, 13], disk_dir=str(disk)))
    assert (done.num_ok, done.corrupt) == (1, [12]) and "corrupt" in done.error
    assert torch.equal(pool[:, :, :, 0], blocks[0])
    done = ex.run(CacheOp(4, STAGE_DISK, [], slots=[2], hashes=[13], segment=seg,
                          disk_dir=str(disk)))
    assert done.num_ok == 1 and done.nbytes == block_file.block_nbytes(ex.geometry)
    ex.run(CacheOp(5, LOAD_HOST, [4], slots=[2], segment=seg))
    assert torch.equal(pool[:, :, :, 4], blocks[2])  # staged whole, loaded from host
    gone = ex.run(CacheOp(6, LOAD_DISK, [3], hashes=[99], disk_dir=str(disk)))
    assert gone.num_ok == 0 and "gone" in gone.error


def test_a_bad_op_fails_alone(rig):
    ex, _, seg, _ = rig
    for op in (CacheOp(7, LOAD_HOST, [NB], slots=[0], segment=seg),  # block out of range
               CacheOp(8, STORE_HOST, [0, 1], slots=[0], segment=seg),  # lengths differ
               CacheOp(9, "bogus", [0])):
        done = ex.run(op)
        assert done.num_ok == 0 and done.error
    assert ex.run(CacheOp(10, STORE_HOST, [0], slots=[1], segment=seg)).num_ok == 1
