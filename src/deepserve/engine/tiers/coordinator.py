"""TierCoordinator: the master's side of the KV tiers below the device, a pure policy object.

Like PDCoordinator it opens no socket and reads time only from `now`; every
event returns TierEffects for the master to carry out. Three pipelines, each
a small object given what it needs (channel.py: the service's address and
ids, the storage queue):

  admit (here; the sched-enqueue stage: the request waits, the batch does not):
      device match -> TierLookup of the hashes past it -> TierHits
      -> cost model (tiers/cost_model.py): fetch the first k hits or none
      (layered.py when the TE loads layer by layer and a hit is on disk)
      -> a holder pseudo-sequence gets blocks for them (none free now: the
         request waits, holding nothing, until that many are, then looks
         again; after op_timeout_s it is computed instead) -> CacheOps load_host /
         load_disk -> every rank's CacheOpsDone -> commit the blocks that came
         up into the prefix tree -> the request is queued (the holder keeps
         them until the scheduler admits it) -> TierRelease
  write-through (writes.py, TierWrites: every block the prefix tree takes, as
      soon as it is computed): new tree nodes, pinned with their ancestors ->
      TierReserve -> CacheOp store_host of the slots given -> CacheOpsDone ->
      TierCommit, unpin. So evicting from the device never has to wait for a
      copy, and a TE that crashes has already handed its blocks to the node.
  contexts (writes.py too: a request that creates a context, SubmitRequest.pin_context):
      when it ends, every full block of its prompt -> TierReserve with the
      context id (pins them all) -> store the absent ones -> TierCommit with
      a reply -> TierCommitted -> only then its last token is streamed.
  stage (staging.py, TierStaging: DualPath's decode read path): a decode task
      brings the disk-only blocks of its prompt up to the host tier through
      its own storage bucket before it orders the prefill.

Every wait has a deadline: a tier service that does not answer is a miss
(lookups, reserves) and a context that cannot be pinned fails its request.
Blocks a worker may still be writing (a load whose ops never came back) are
never handed out again: a holder whose ops time out keeps its blocks until
op_timeout_s more have passed (the workers of a TE die together).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.cache.radix_tree import RadixNode
from deepserve.engine.sequence import Sequence
from deepserve.engine.tiers.channel import (PREFILL_PATH, StorageQueue, TierChannel,
                                            TierEffects, lookup_below)
from deepserve.engine.tiers.layered import STREAM, TierLayered, with_stream
from deepserve.engine.tiers.staging import TierStaging
from deepserve.engine.tiers.writes import TierWrites
from deepserve.messages.cache import (LOAD_DISK, LOAD_HOST, ON_DISK, ON_STREAM, BlockGeometry,
                                      CacheOp, CacheOpsDone, TierCommitted, TierHits,
                                      TierReserved)
from deepserve.tiers.cost_model import DISK, HOST, CostModel

log = logging.getLogger(__name__)


@dataclass
class _Lookup:
    seq: Sequence
    num_device: int
    hashes: list[int]
    deadline: float
    room_deadline: float | None = None  # it waited for room before this lookup: until then


@dataclass
class _WaitingForRoom:
    """A request whose hits found no device blocks to load into: it holds
    no lease (released) and looks again once num_blocks are free; its disk
    hits are read meanwhile into the PE buffer, where there is one
    (staging.py: read_ahead). Recomputing it instead would take as many
    blocks, and the compute too."""

    seq: Sequence
    num_blocks: int
    deadline: float
    num_disk: int = 0  # of its hits, the ones it will read from storage (its read queue)


@dataclass
class _Load:
    seq: Sequence
    holder: int  # seq id of the holder
    first_block: int  # the holder's first block that a lower tier fills
    ops: list[tuple[int, str, int]]  # (op id, kind, blocks), in block order
    lease_id: int
    started: float
    deadline: float
    done: dict[int, dict[int, CacheOpsDone]] = field(default_factory=dict)


class TierCoordinator:
    def __init__(self, kv: KVCacheManager, *, model_key: str, geometry: BlockGeometry,
                 address: str, cost: CostModel, tp: int, new_seq_id, lookup_timeout_s=1.0,
                 op_timeout_s: float = 10.0):
        self.kv, self.cost, self.new_seq_id = kv, cost, new_seq_id
        self.channel = TierChannel(model_key, geometry, address, tp, lookup_timeout_s,
                                   op_timeout_s)
        self.storage = StorageQueue(cost.block_bytes, tp, op_timeout_s)
        self.writes = TierWrites(kv, self.channel)
        self.staging = TierStaging(kv, self.channel, self.storage)
        self.block_size = kv.block_size
        self.lookups: dict[int, _Lookup] = {}
        self.loads: dict[int, _Load] = {}  # by op id of each of its ops
        self.stalled: list[tuple[int, float]] = []  # (holder seq id, free after)
        self.waiting: deque[_WaitingForRoom] = deque()  # oldest first
        self.hit_tokens = {HOST: 0, DISK: 0, STREAM: 0}
        self.lookups_by_outcome: Counter[str] = Counter()  # cumulative: TEReport.tier_lookups
        self.fetch_seconds: dict[str, list[float]] = {HOST: [], DISK: []}
        self.num_events = 0  # progress: tier events handled
        self.layered = TierLayered(kv, self.channel, self.storage, self._count)

    @property
    def has_work(self) -> bool:
        return bool(self.lookups or self.loads or self.waiting or self.writes.has_work
                    or self.staging.has_work or self.layered.has_work)

    # -- the other pipelines' entries --------------------------------------------------
    def write_through(self, now: float, context: Sequence | None = None,
                      nodes: list[RadixNode] | None = None) -> TierEffects:
        return self.writes.write_through(now, context, nodes)

    def stage(self, seq: Sequence, now: float, prefill_from: str = "") -> TierEffects:
        return self.staging.stage(seq, now, prefill_from)

    def unstage(self, seq_id: int) -> TierEffects:
        effects = TierEffects()
        self.staging.unstage(seq_id, effects)
        return effects

    def on_committed(self, msg: TierCommitted, now: float) -> TierEffects:
        self.num_events += 1
        return self.writes.on_committed(msg, now)

    def on_reserved(self, msg: TierReserved, now: float) -> TierEffects:
        self.num_events += 1
        effects = TierEffects()
        if self.staging.on_reserved(msg, now, effects):
            return effects
        return self.writes.on_reserved(msg, now)

    # -- admit ---------------------------------------------------------------------------
    def admit(self, seq: Sequence, now: float) -> TierEffects:
        """A new request: look below the device for its prefix, or queue it now."""
        effects = TierEffects()
        self._look(seq, now, effects)
        return effects

    def _look(self, seq: Sequence, now: float, effects: TierEffects,
              room_deadline: float | None = None) -> None:
        found = lookup_below(self.kv, self.channel, seq)
        if found is None:
            self.staging.settle_read_ahead(seq, False, effects)
            effects.ready.append(seq)
            return
        lookup, num_device = found
        lookup.prefill_tokens_per_s = self.cost.prefill_tokens_per_s  # remote: worth it?
        self.lookups[lookup.lookup_id] = _Lookup(seq, num_device, lookup.hashes,
                                                 now + self.channel.lookup_timeout_s,
                                                 room_deadline)
        effects.sends.append(lookup)

    def on_hits(self, msg: TierHits, now: float) -> TierEffects:
        effects = TierEffects()
        self.num_events += 1
        if self.staging.on_hits(msg, now, effects):
            return effects
        lookup = self.lookups.pop(msg.lookup_id, None)
        if lookup is None or lookup.seq.is_finished:
            self.channel.release(msg.lease_id, effects)
            return effects
        seq = lookup.seq
        slots = with_stream(seq.kv_stream if self.channel.tp == 1 else None, lookup.hashes,
                            msg.slots[:len(lookup.hashes)])
        tiers = [DISK if s == ON_DISK else HOST for s in slots]  # a stream: as host memory
        plan = self.cost.plan(tiers)
        log.debug("seq %d: %d device + %s below; plan %s (%s)", seq.seq_id, lookup.num_device,
                  tiers, plan, self.cost.snapshot())
        if not tiers:
            outcome = "none"
        elif plan.num_blocks == 0:
            outcome = "recompute"
        else:
            outcome = self._start_load(lookup, msg, slots, plan.num_blocks, now, effects)
        fetching = outcome in ("fetch", "fetch_layers")  # it releases the lease when done
        if not fetching:
            self.channel.release(msg.lease_id, effects)
        need = lookup.num_device + plan.num_blocks
        if self.layered.layers or ON_STREAM in slots:  # a layered load: the whole prompt
            need = max(need, self.kv.num_blocks_for(seq.num_tokens))
        if outcome == "no_room" and need <= self.kv.num_blocks:  # it can fit: wait for room
            deadline = lookup.room_deadline or now + self.channel.op_timeout_s
            disk = [h for h, s in zip(lookup.hashes, slots[:plan.num_blocks]) if s == ON_DISK]
            ahead = bool(self.layered.layers) and self.staging.read_ahead(
                seq, disk, msg.disk_dir, now, effects)  # meanwhile, into its PE buffer
            self.lookups_by_outcome["no_room_read_ahead" if ahead else outcome] += 1
            self.waiting.append(_WaitingForRoom(seq, need, deadline, 0 if ahead else len(disk)))
            return effects
        self.lookups_by_outcome[outcome] += 1
        self.staging.settle_read_ahead(seq, outcome == "fetch_layers" and ON_STREAM in slots,
                                       effects)
        if not fetching:
            effects.ready.append(seq)
        return effects

    def _start_load(self, lookup: _Lookup, msg: TierHits, slots: list[int], k: int,
                    now: float, effects: TierEffects) -> str:
        """"fetch" or "fetch_layers" (started), or why not: "no_room" (no device blocks for
        them now), "gap" (device blocks evicted meanwhile, or it has them all)."""
        seq, bs = lookup.seq, self.block_size
        layered = any(s == ON_STREAM or s == ON_DISK and self.layered.layers
                      for s in slots[:k])  # a stream is pulled layer by layer
        holder = seq.seq_id if layered else self.new_seq_id()  # layered: all its prompt
        if not self.kv.allocate(holder, seq.token_ids,
                                seq.num_tokens if layered else (lookup.num_device + k) * bs,
                                seq.salt):
            return "no_room"
        first = self.kv.num_shared_blocks(holder)
        skip = first - lookup.num_device  # blocks the device got meanwhile
        if skip < 0 or skip >= k:  # device blocks evicted meanwhile (a gap), or nothing left
            self.kv.free(holder)
            return "gap"
        if layered:
            self.layered.start(seq, lookup.num_device, lookup.hashes, msg, slots, skip, k, now,
                               effects, read_ahead=seq.seq_id in self.staging.ahead)
            return "fetch_layers"
        table = self.kv.block_table(holder)
        ops: list[CacheOp] = []
        for i in range(skip, k):  # runs of one tier each, in block order
            slot, block = msg.slots[i], table[lookup.num_device + i]
            kind = LOAD_DISK if slot == ON_DISK else LOAD_HOST
            if not ops or ops[-1].kind != kind:
                ops.append(CacheOp(self.channel.next_id(), kind, [], segment=msg.segment,
                                   disk_dir=msg.disk_dir))
            ops[-1].block_ids.append(block)
            if kind == LOAD_DISK:
                ops[-1].hashes.append(lookup.hashes[i])
            else:
                ops[-1].slots.append(slot)
        self.storage.num_blocks += sum(len(op.block_ids) for op in ops if op.kind == LOAD_DISK)
        load = _Load(seq, holder, first, [(op.op_id, op.kind, len(op.block_ids)) for op in ops],
                     msg.lease_id, now, now + self.storage.op_deadline_s())
        for op in ops:
            self.loads[op.op_id] = load
        effects.ops.extend(ops)
        return "fetch"

    def _count(self, seq: Sequence, tier: str, num_blocks: int, seconds: float | None = None
               ) -> None:
        if num_blocks and seconds is not None:
            self.cost.observe_fetch(tier, num_blocks * self.cost.block_bytes, seconds)
            self.fetch_seconds[tier].append(seconds)
        seq.tier_tokens[tier] = seq.tier_tokens.get(tier, 0) + num_blocks * self.block_size
        self.hit_tokens[tier] += num_blocks * self.block_size

    def lost_layers(self, corrupt: list[int]) -> TierEffects:
        """A layered load failed in its forward: its corrupt files leave the tier."""
        self.lookups_by_outcome["layers_lost"] += 1
        effects = TierEffects()
        self.channel.drop_corrupt(corrupt, effects)
        return effects

    def _finish_load(self, load: _Load, now: float, effects: TierEffects) -> None:
        for op_id, _, _ in load.ops:
            self.loads.pop(op_id, None)
        num_ok, corrupt = 0, []
        for op_id, kind, n in load.ops:  # what this TE read from storage: the prefill path
            if kind == LOAD_DISK:
                self.storage.num_blocks -= n
                self.storage.bytes_read[PREFILL_PATH] += sum(
                    d.nbytes for d in load.done[op_id].values())
        for op_id, kind, n in load.ops:
            ranks = load.done[op_id].values()
            ok = min(d.num_ok for d in ranks)
            corrupt += [h for d in ranks for h in d.corrupt]
            if ok:
                self._count(load.seq, DISK if kind == LOAD_DISK else HOST, ok,
                            now - load.started)
            num_ok += ok
            if ok < n:
                break
        self.channel.drop_corrupt(corrupt, effects)
        seq = load.seq
        self.kv.commit(load.holder, seq.token_ids, (load.first_block + num_ok) * self.block_size)
        self.kv.truncate(load.holder, load.first_block + num_ok)
        self.channel.release(load.lease_id, effects)
        if seq.is_finished:
            self.kv.free(load.holder)
            return
        seq.holder_seq_id = load.holder
        effects.ready.append(seq)

    # -- workers -------------------------------------------------------------------------
    def on_ops_done(self, msg: CacheOpsDone, now: float) -> TierEffects:
        effects = TierEffects()
        self.num_events += 1
        load = self.loads.get(msg.op_id)
        if load is not None:
            load.done.setdefault(msg.op_id, {})[msg.rank] = msg
            if all(len(load.done.get(op_id, {})) == self.channel.tp for op_id, _, _ in load.ops):
                self._finish_load(load, now, effects)
            return effects
        if self.layered.on_done(msg, now, effects):
            return effects
        if not self.staging.on_done(msg, now, effects):
            self.writes.on_done(msg, now, effects)
        return effects

    # -- deadlines ---------------------------------------------------------------------
    def poll(self, now: float) -> TierEffects:
        effects = TierEffects()
        for lookup_id, lookup in list(self.lookups.items()):
            if now > lookup.deadline:  # the tier service is slow or gone: a miss
                del self.lookups[lookup_id]
                self.lookups_by_outcome["timeout"] += 1
                if not lookup.seq.is_finished:
                    effects.ready.append(lookup.seq)
        for load in {id(v): v for v in self.loads.values()}.values():
            if now > load.deadline:
                log.warning("cache ops of seq %d not done in %g s", load.seq.seq_id,
                            self.channel.op_timeout_s)
                for op_id, kind, n in load.ops:
                    self.loads.pop(op_id, None)
                    self.storage.num_blocks -= n if kind == LOAD_DISK else 0
                self.stalled.append((load.holder, now + self.channel.op_timeout_s))
                if not load.seq.is_finished:
                    effects.ready.append(load.seq)
        self._poll_waiting(now, effects)
        self.layered.poll(now, effects)
        self.writes.poll(now, effects)
        self.staging.poll(now, effects)
        for holder, after in [s for s in self.stalled if now > s[1]]:
            self.stalled.remove((holder, after))
            if self.kv.has_seq(holder):
                self.kv.free(holder)
        return effects

    def _poll_waiting(self, now: float, effects: TierEffects) -> None:
        """Requests waiting for room look again, oldest first, while the free
        blocks cover them (each counted once: the lookups are answered later);
        past its deadline, a request is computed instead."""
        for w in [w for w in self.waiting if w.seq.is_finished or now > w.deadline]:
            self.waiting.remove(w)
            if not w.seq.is_finished:
                self.lookups_by_outcome["room_timeout"] += 1
                self.staging.settle_read_ahead(w.seq, False, effects)
                effects.ready.append(w.seq)
        free, room = self.kv.num_free_blocks, []
        for w in self.waiting:
            if free < w.num_blocks:
                break
            if w.seq.seq_id in self.staging.reading_ahead:  # its reads are under way: the
                continue  # room goes to the next, which would wait behind them otherwise
            room.append(w)
            free -= w.num_blocks
        for w in room:
            self.waiting.remove(w)
            self._look(w.seq, now, effects, w.deadline)

    @property
    def read_queue_blocks(self) -> int:
        """Blocks this TE has yet to read from storage: those dispatched and not
        done, and the disk hits of the requests waiting for room (they read them
        as soon as they get it; DualPath's scheduler weighs this queue)."""
        return self.storage.num_blocks + sum(w.num_disk for w in self.waiting)

    def pop_stats(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        """Cumulative hit tokens per tier; fetch seconds since the last call."""
        seconds, self.fetch_seconds = self.fetch_seconds, {HOST: [], DISK: []}
        return dict(self.hit_tokens), seconds
