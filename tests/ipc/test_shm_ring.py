"""BroadcastRing: one writer (this process), readers in spawned processes.

The reader entry point is module-level so spawned children can import it as
`tests.ipc.test_shm_ring`. Every child is joined with a timeout and killed if
it is still alive; the `run_id` fixture checks that no segment is left.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import random
import stat
import time
from typing import Callable, Iterator

import pytest

from deepserve.ipc.segments import create_segment, segment_name, unlink_segment
from deepserve.ipc.shm_ring import BroadcastRing, RingNotReady

SLOT_BYTES = 4096
NUM_MESSAGES = 2000
WAIT_S = 30.0  # generous: a spawned child needs seconds to import torch via deepserve


def message(i: int, slot_bytes: int = SLOT_BYTES) -> bytes:
    """Message i: empty, tiny, exactly one slot, one byte over, many slots..."""
    sizes = (0, 1, 100, slot_bytes - 1, slot_bytes, slot_bytes + 1, 3 * slot_bytes + 5)
    rng = random.Random(i)
    size = sizes[i % len(sizes)] if i % 11 else rng.randrange(0, 2 * slot_bytes)
    return rng.randbytes(size)


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def reader_main(name: str, rank: int, overflow_address: str | None, num_messages: int,
                results: mp.Queue, delay_s: float = 0.0, start=None) -> None:
    """Child: read `num_messages`, send back (rank, digests) or (rank, error)."""
    try:
        if start is not None:
            start.wait(WAIT_S)
        digests = []
        with BroadcastRing.attach(name, rank, overflow_address) as ring:
            for _ in range(num_messages):
                digests.append(digest(ring.get(timeout=WAIT_S)))
                time.sleep(delay_s)
        results.put((rank, digests))
    except BaseException as exc:
        results.put((rank, repr(exc)))
        raise


@contextlib.contextmanager
def spawned(ctx, targets: list[tuple[Callable, tuple]]) -> Iterator[list]:
    """Start one process per (target, args); join, terminate or kill them all."""
    procs = [ctx.Process(target=fn, args=args, daemon=True) for fn, args in targets]
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            proc.join(timeout=WAIT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def test_two_readers_get_every_message_in_order(run_id, short_dir):
    name = segment_name(run_id, "ring")
    address = f"ipc://{short_dir}/ovf"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    readers = [(reader_main, (name, rank, address, NUM_MESSAGES, results)) for rank in (0, 1)]
    with BroadcastRing.create(name, num_readers=2, slot_bytes=SLOT_BYTES, num_slots=8,
                              overflow_address=address) as ring:
        with spawned(ctx, readers) as procs:
            expected = []
            for i in range(NUM_MESSAGES):
                data = message(i)
                ring.put(data, timeout=WAIT_S)
                expected.append(digest(data))
            got = dict(results.get(timeout=WAIT_S) for _ in readers)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sum(len(message(i)) > SLOT_BYTES for i in range(NUM_MESSAGES)) > 100  # overflow
    assert got[0] == expected
    assert got[1] == expected
    assert not os.listdir(short_dir)  # overflow socket files removed


def test_slow_reader_blocks_writer_and_nothing_is_overwritten(run_id):
    name = segment_name(run_id, "ring")
    ctx = mp.get_context("spawn")
    results, start = ctx.Queue(), ctx.Event()
    msgs = [bytes([i]) * (i * 7 % 65) for i in range(20)]  # 5 laps round 4 slots
    with BroadcastRing.create(name, num_readers=1, slot_bytes=64, num_slots=4) as ring:
        slow_reader = (reader_main, (name, 0, None, len(msgs), results, 0.01, start))
        with spawned(ctx, [slow_reader]) as procs:
            for data in msgs[:4]:
                ring.put(data, timeout=1.0)
            with pytest.raises(TimeoutError):
                ring.put(msgs[4], timeout=0.1)  # the ring is full: must not overwrite
            start.set()
            for data in msgs[4:]:
                ring.put(data, timeout=WAIT_S)
            rank, digests = results.get(timeout=WAIT_S)
    assert procs[0].exitcode == 0
    assert digests == [digest(data) for data in msgs]


def test_get_times_out_without_writer_activity(run_id):
    name = segment_name(run_id, "ring")
    with BroadcastRing.create(name, num_readers=1) as ring:
        with BroadcastRing.attach(name, 0) as reader:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                reader.get(timeout=0.1)
            assert 0.09 <= time.monotonic() - started <= 1.0
            ring.put(b"late", timeout=1.0)
            assert reader.get(timeout=1.0) == b"late"


def test_put_times_out_when_a_reader_never_reads(run_id):
    name = segment_name(run_id, "ring")
    with BroadcastRing.create(name, num_readers=2, slot_bytes=16, num_slots=4) as ring:
        with BroadcastRing.attach(name, 0) as eager, BroadcastRing.attach(name, 1) as idle:
            for i in range(4):
                ring.put(bytes([i]), timeout=1.0)
                assert eager.get(timeout=1.0) == bytes([i])
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                ring.put(b"four", timeout=0.1)
            assert 0.09 <= time.monotonic() - started <= 1.0
            assert idle.get(timeout=1.0) == bytes([0])  # frees slot 0
            ring.put(b"four", timeout=1.0)
            assert eager.get(timeout=1.0) == b"four"


def test_overflow_waits_for_readers_and_drops_stale_frames(run_id, short_dir):
    name = segment_name(run_id, "ring")
    address = f"ipc://{short_dir}/ovf"
    big_a, big_b = b"a" * 1000, b"b" * 2000
    with BroadcastRing.create(name, num_readers=2, slot_bytes=64,
                              overflow_address=address) as ring:
        with BroadcastRing.attach(name, 0, address) as first:
            with pytest.raises(TimeoutError):
                ring.put(big_a, timeout=0.2)  # reader 1 has not connected yet
            with BroadcastRing.attach(name, 1, address) as second:
                ring.put(big_b, timeout=5.0)
                assert first.get(timeout=5.0) == big_b  # big_a's frame is dropped
                assert second.get(timeout=5.0) == big_b
        with pytest.raises(ValueError):
            BroadcastRing.attach(name, 2)


def test_oversized_message_needs_an_overflow_address(run_id):
    name = segment_name(run_id, "ring")
    with BroadcastRing.create(name, num_readers=1, slot_bytes=64) as ring:
        ring.put(b"x" * 64, timeout=1.0)
        with pytest.raises(ValueError):
            ring.put(b"x" * 65, timeout=1.0)


def test_segment_is_private_and_unlink_is_final(run_id):
    name = segment_name(run_id, "ring")
    ring = BroadcastRing.create(name, num_readers=1, slot_bytes=64)
    reader = BroadcastRing.attach(name, 0)
    assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
    with pytest.raises(RuntimeError):
        reader.unlink()
    ring.unlink()
    ring.unlink()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(FileNotFoundError):
        BroadcastRing.attach(name, 0)
    ring.put(b"still mapped", timeout=1.0)  # unlink removes the name, not the memory
    assert reader.get(timeout=1.0) == b"still mapped"
    reader.close()
    ring.close()
    ring.close()  # idempotent


def test_a_ring_caught_half_made_is_not_ready_and_a_foreign_segment_is_refused(run_id):
    """A reader that attaches between the writer's create and its header gets
    RingNotReady (retry), whether the segment is still 0 bytes or its header
    still zero; a segment with some other header is a plain ValueError."""
    name = segment_name(run_id, "ring")
    with open(f"/dev/shm/{name}", "wb"):  # created, not yet sized
        pass
    try:
        with pytest.raises(RingNotReady, match="not sized"):
            BroadcastRing.attach(name, 0)
    finally:
        unlink_segment(name)
    for header, error in ((b"\0" * 64, RingNotReady), (b"\xff" * 64, ValueError)):
        shm = create_segment(name, 4096)
        shm.buf[:64] = header
        try:
            with pytest.raises(ValueError) as caught:
                BroadcastRing.attach(name, 0)
            assert type(caught.value) is error
        finally:
            shm.close()
            unlink_segment(name)
    with BroadcastRing.create(name, num_readers=1, slot_bytes=64) as ring:
        reader = BroadcastRing.attach(name, 0)  # the finished ring attaches
        ring.put(b"ok", timeout=1.0)
        assert reader.get(timeout=1.0) == b"ok"
        reader.close()
