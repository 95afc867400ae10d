"""TierLayered: hits loaded layer by layer (EngineConfig.kv_load_layers > 0).

The admit pipeline (coordinator.py) has given the request its own blocks for
its whole prompt; the hits go straight into them, never through a holder or
the prefix tree, so no other request can read them half-loaded:

    CacheOp load_layers (host hits, then disk hits: the worker copies the host
    ones whole, opens the disk ones and reads their first `layers` layers)
    -> CacheOpsDone(num_ok) -> the request queues with its first num_ok hit
    blocks counted as computed (Sequence.preloaded_tokens) -> its first
    forward reads the other layers as it computes (worker/layer_loads.py)
    -> the blocks enter the prefix tree when that step is done, as computed
    ones do. A read that fails inside the forward comes back as
    StepOutput.lost_loads: the master fails the request retryably.

No CacheOpsDone by the op deadline: the worker is told to drop the load
(CacheOp drop_layers, ahead of any forward of the request) and the request
computes those blocks itself.

A prefill task whose decode TE read hits for it into a layer stream
(PrefillOrder.kv_stream, DualPath across hosts: staging.py) takes the
stream's blocks (ON_STREAM) in place of its own disk hits and of the misses
past them (with_stream); those are always pulled layer by layer, through a
ring of kv_load_layers (all the layers when that is 0). They count as tier
"stream". A prefill TE's read-ahead of its own disk hits into its PE buffer
(staging.py) comes the same way, read in place, and counts as tier "disk".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.sequence import Sequence
from deepserve.engine.tiers.channel import PREFILL_PATH, StorageQueue, TierChannel, TierEffects
from deepserve.messages.cache import (DROP_LAYERS, LOAD_LAYERS, ON_DISK, ON_STREAM, CacheOp,
                                      CacheOpsDone, TierHits)
from deepserve.messages.pd import KVStream
from deepserve.tiers.cost_model import DISK, HOST

STREAM = "stream"  # the hit tier of blocks pulled from a decode TE's layer stream


def with_stream(stream: KVStream | None, hashes: list[int], slots: list[int]) -> list[int]:
    """A lookup's slots (the leading run held below the device) with the
    stream's blocks as ON_STREAM in place of disk hits and of misses past them
    (host hits stay: cheaper); the run ends at the first block neither has."""
    if stream is None:
        return slots
    held = set(stream.hashes)
    out = []
    for i, h in enumerate(hashes):
        slot = slots[i] if i < len(slots) else None
        if slot is not None and slot != ON_DISK:
            out.append(slot)
        elif h in held:
            out.append(ON_STREAM)
        elif slot is not None:
            out.append(slot)
        else:
            break
    return out


@dataclass
class _Layered:
    seq: Sequence
    first_block: int  # its first block a lower tier fills
    slots: list[int]  # per block: a host slot, or ON_DISK
    lease_id: int
    started: float
    deadline: float
    read_ahead: bool = False  # its stream is this TE's own read-ahead (disk hits read early)

    @property
    def num_disk(self) -> int:
        return self.slots.count(ON_DISK)


class TierLayered:
    """count(seq, tier, blocks, seconds=None): the coordinator's hit counters."""

    def __init__(self, kv: KVCacheManager, channel: TierChannel, storage: StorageQueue,
                 count: Callable[..., None]):
        self.kv, self.channel, self.storage, self.count = kv, channel, storage, count
        self.layers = 0  # EngineConfig.kv_load_layers (the link sets it): 0 is off
        self.loads: dict[int, _Layered] = {}  # by op id

    @property
    def has_work(self) -> bool:
        return bool(self.loads)

    def start(self, seq: Sequence, num_device: int, hashes: list[int], msg: TierHits,
              slots: list[int], skip: int, k: int, now: float, effects: TierEffects,
              read_ahead: bool = False) -> None:
        """Hits skip..k-1 (past num_device device blocks; slots: msg's, with_stream)
        into seq's own blocks; read_ahead: seq's stream is this TE's own (staging.py)."""
        table = self.kv.block_table(seq.seq_id)
        rows = range(skip, k)
        stream = seq.kv_stream
        row_of = {h: r for r, h in enumerate(stream.hashes)} if stream is not None else {}
        op = CacheOp(self.channel.next_id(), LOAD_LAYERS, [table[num_device + i] for i in rows],
                     slots=[slots[i] for i in rows],
                     hashes=[hashes[i] if slots[i] == ON_DISK else 0 for i in rows],
                     segment=msg.segment, disk_dir=msg.disk_dir, seq_id=seq.seq_id,
                     layers=self.layers or self.channel.geometry.num_layers)
        if ON_STREAM in op.slots:
            op.stream, op.stream_id = stream.address, stream.stream_id
            op.stream_rows = [row_of[hashes[i]] for i in rows if slots[i] == ON_STREAM]
        load = _Layered(seq, num_device + skip, op.slots, msg.lease_id, now,
                        now + self.storage.op_deadline_s(), read_ahead)
        self.storage.num_blocks += load.num_disk
        self.loads[op.op_id] = load
        effects.ops.append(op)

    def on_done(self, msg: CacheOpsDone, now: float, effects: TierEffects) -> bool:
        """Its first layers are read (tp 1: one rank): the request queues."""
        load = self.loads.pop(msg.op_id, None)
        if load is None:
            return False
        self.storage.num_blocks -= load.num_disk
        self.storage.bytes_read[PREFILL_PATH] += msg.nbytes
        self.channel.drop_corrupt(msg.corrupt, effects)
        seq = load.seq
        if msg.num_ok:
            disk = load.slots[:msg.num_ok].count(ON_DISK)
            streamed = load.slots[:msg.num_ok].count(ON_STREAM)
            self.count(seq, DISK, disk, now - load.started)  # the wait for the first layers
            if streamed:  # a decode TE's, or read ahead from storage by this TE: disk
                self.count(seq, DISK if load.read_ahead else STREAM, streamed)
            self.count(seq, HOST, msg.num_ok - disk - streamed)
        else:
            self._drop(seq, effects)
        self.channel.release(load.lease_id, effects)
        if not seq.is_finished:  # else its blocks went with it; the worker drops the load
            seq.preloaded_tokens = (load.first_block + msg.num_ok) * self.kv.block_size
            effects.ready.append(seq)
        return True

    def poll(self, now: float, effects: TierEffects) -> None:
        for op_id, load in [(i, x) for i, x in self.loads.items() if now > x.deadline]:
            del self.loads[op_id]
            self.storage.num_blocks -= load.num_disk
            self._drop(load.seq, effects)
            self.channel.release(load.lease_id, effects)
            if not load.seq.is_finished:
                load.seq.preloaded_tokens = load.first_block * self.kv.block_size
                effects.ready.append(load.seq)

    def _drop(self, seq: Sequence, effects: TierEffects) -> None:
        effects.ops.append(CacheOp(self.channel.next_id(), DROP_LAYERS, [], seq_id=seq.seq_id))
