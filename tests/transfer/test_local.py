"""DistFlow in one process: frame layouts, index paths, dtypes, error paths.

Cheap checks of mechanisms the two-process tests do not reach: the
zero-copy and packed tcp framings, the index_select/index_copy_ paths for
scattered ids, bf16, short writes and checksum mismatches, and shutdown.
"""

from __future__ import annotations

import random
import threading

import msgspec
import pytest
import torch
import zmq

from deepserve.ipc.segments import segment_name
from deepserve.transfer import (DistFlow, DistFlowReceiver, PeerEndpoint, PoolRegion,
                                TransferError, layout, net_link, shm_link)
from deepserve.transfer.wire import Ack, Push
from tests.transfer.conftest import pool_segment

BIG = (2, 2, 2, 128, 16, 64)  # 4 KiB rows: consecutive runs make zero-copy frames


@pytest.fixture
def pools(run_id):
    """(src, dst) pools in segments; dst's segment name for shm links."""
    src_name, dst_name = segment_name(run_id, "lsrc"), segment_name(run_id, "ldst")
    with pool_segment(src_name, BIG) as src, pool_segment(dst_name, BIG) as dst:
        src.copy_(torch.randn(BIG))
        yield src, dst, dst_name


@pytest.fixture
def receiver(pools):
    rec = DistFlowReceiver(pools[1])
    yield rec
    rec.close()


def _flow(src, **kw) -> DistFlow:
    return DistFlow(src, timeout_s=kw.pop("timeout_s", 5.0), **kw)


@pytest.mark.parametrize("backend", ["shm", "tcp", "ring"])
@pytest.mark.parametrize("ids", ["all", "run", "permuted"])
def test_local_transfer(pools, receiver, backend, ids):
    src, dst, name = pools
    nb = BIG[3]
    src_ids = {"all": list(range(nb)), "run": list(range(8, 40)),
               "permuted": random.Random(0).sample(range(nb), nb)}[ids]  # 64 runs+: index path
    dst_ids = list(range(nb)) if ids != "run" else list(range(20, 52))
    df = _flow(src, ring_bytes=64 << 10)
    try:
        df.link("d", receiver.endpoint(name), backend)
        df.transfer("d", PoolRegion(src_ids), PoolRegion(dst_ids), checksum=True).wait(10)
        assert torch.equal(dst[:, :, :, dst_ids], src[:, :, :, src_ids])
    finally:
        df.close()


def test_tcp_frames_are_zero_copy_slices_or_one_packed_tensor(pools, receiver):
    src, _, _ = pools
    df = _flow(src)
    try:
        df.link("d", receiver.endpoint(), "tcp")
        link = df._links["d"]
        ids = list(range(8, 40))
        frames = link._data_frames(ids, (0, 2), layout.row_index(BIG, ids, (0, 2)))
        assert len(frames) == 2 * 2 * 2  # one per (kv, layer, head)
        assert all(f.base is not None for f in frames)  # views of the pool
        every = list(range(BIG[3]))
        whole = link._data_frames(every, (0, 2), layout.row_index(BIG, every, (0, 2)))
        assert len(whole) == 1 and whole[0].nbytes == src.numel() * 4  # merged
        scattered = random.Random(1).sample(range(BIG[3]), 40)
        packed = link._data_frames(scattered, (0, 2), layout.row_index(BIG, scattered, (0, 2)))
        assert len(packed) == 1
    finally:
        df.close()


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://[::]:0"])
def test_receiver_refuses_a_wildcard_bind(pools, bind):
    """The endpoint advertises the bound address; a wildcard one would reach no sender."""
    with pytest.raises(ValueError, match="wildcard"):
        DistFlowReceiver(pools[1], bind=bind)


def test_bf16_pools_over_tcp():
    shape = (2, 2, 2, 8, 4, 8)
    src = torch.randn(shape).to(torch.bfloat16)
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    rec, df = DistFlowReceiver(dst), _flow(src)
    try:
        df.link("d", rec.endpoint())
        result = df.transfer("d", PoolRegion([7, 0, 3], (1, 2)), PoolRegion([1, 2, 5], (1, 2)),
                             checksum=True).wait(10)
        assert torch.equal(dst[:, 1:2, :, [1, 2, 5]], src[:, 1:2, :, [7, 0, 3]])
        assert result.nbytes == 2 * 1 * 2 * 3 * 32 * 2
    finally:
        df.close()
        rec.close()


def test_short_write_surfaces_as_an_error(pools, receiver, monkeypatch):
    src, dst, _ = pools
    real = net_link.TcpLink._data_frames
    monkeypatch.setattr(net_link.TcpLink, "_data_frames",
                        lambda self, *a: real(self, *a)[:-1])  # lose the last frame
    df = _flow(src)
    try:
        df.link("d", receiver.endpoint(), "tcp")
        with pytest.raises(TransferError, match="short write"):
            df.transfer("d", PoolRegion(list(range(8))), PoolRegion(list(range(8)))).wait(10)
        assert not dst.any()  # nothing written
    finally:
        df.close()


def test_receiver_acks_short_and_bad_pushes(pools, receiver):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.address)
    row = 16 * 64 * 4
    nbytes = 2 * 2 * 2 * row
    try:
        cases = [(Push(1, [0], (0, 2), nbytes, False), [b"x" * (nbytes - row)], "short write"),
                 (Push(2, [0], (0, 2), nbytes, False), [b"x" * (nbytes - 1), b"x"], "short write"),
                 (Push(3, [128], (0, 2), nbytes, False), [b"x" * nbytes], "out of range"),
                 (Push(4, [0], (0, 2), 5, False), [b"x" * 5], "region holds")]
        for push, frames, why in cases:
            sock.send_multipart([msgspec.msgpack.encode(push), *frames])
            assert sock.poll(5000)
            ack = msgspec.msgpack.decode(sock.recv(), type=Ack)
            assert (ack.tid, ack.ok) == (push.tid, False) and why in ack.error
    finally:
        sock.close()


def test_checksum_mismatch_is_an_error(pools, monkeypatch):
    src, _, name = pools
    calls = iter([1, 2])
    monkeypatch.setattr(shm_link.layout, "checksum_region", lambda *a: next(calls))
    df = _flow(src)
    try:
        df.link("d", PeerEndpoint(shape=BIG, dtype="float32", shm=name))
        with pytest.raises(TransferError, match="checksum mismatch"):
            df.transfer("d", PoolRegion([0]), PoolRegion([0]), checksum=True).wait(10)
    finally:
        df.close()


def test_empty_region_callback_and_close(pools):
    src, _, name = pools
    df = _flow(src)
    df.link("d", PeerEndpoint(shape=BIG, dtype="float32", shm=name))
    seen = threading.Event()
    handle = df.transfer("d", PoolRegion([]), PoolRegion([]), checksum=True)
    handle.add_done_callback(lambda h: seen.set())
    result = handle.wait(10)
    assert (result.nbytes, result.checksum) == (0, 0) and seen.wait(5) and handle.done()
    df.close()
    with pytest.raises(TransferError, match="closed|no link"):
        df.transfer("d", PoolRegion([0]), PoolRegion([0]))
    assert not [t for t in threading.enumerate() if t.name.startswith("distflow-") and
                t.is_alive() and t.name != "distflow-recv"]


def test_unreachable_tcp_link_times_out(pools):
    src, _, _ = pools
    df = _flow(src, timeout_s=0.3)
    try:
        with pytest.raises(TransferError):  # nothing listens there
            df.link("d", PeerEndpoint(shape=BIG, dtype="float32", tcp="tcp://127.0.0.1:9"))
    finally:
        df.close()


def test_a_one_host_receiver_listens_on_a_private_ipc_path(pools):
    """No loopback TCP port that any local user could reach: an ipc:// path in a
    directory only this user enters (0700), gone when the receiver closes; a
    TE's kv_bind_host picks it on loopback, tcp on its host's address."""
    from pathlib import Path

    from deepserve.ipc.sockets import LOCAL
    from deepserve.transfer.receiver import kv_bind
    rec = DistFlowReceiver(pools[1])
    directory = Path(rec.address[len("ipc://"):]).parent
    try:
        assert rec.address.startswith("ipc://") and rec.endpoint().tcp == rec.address
        assert directory.stat().st_mode & 0o777 == 0o700
    finally:
        rec.close()
    assert not directory.exists()
    assert kv_bind("127.0.0.1") == kv_bind("::1") == LOCAL
    assert kv_bind("10.0.0.5") == "tcp://10.0.0.5:0"
