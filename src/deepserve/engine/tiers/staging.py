"""TierStaging: DualPath's decode-engine read path.

A decode task told to read the prompt's cached KV itself (read_path
"decode": the job executor's DualPath scheduler saw this TE's storage read
queue shorter than its prefill TE's) first brings the blocks that only the
disk tier holds up into the node's host tier, through this TE's own storage
bucket ([[te]] storage_read_gbps), and only then orders the prefill. The
prefill TE then finds them in host memory (its lookup, coordinator.py)
instead of reading storage through its own bucket:

    TierLookup (every cacheable block: the prefill TE needs them, whatever this TE
    holds) ──TierHits──> the ON_DISK ones
    ──TierReserve──> host slots ──CacheOp stage (rank 0: file -> slot, bucket)──>
    CacheOpsDone ──TierCommit(hold)──> staged: the master orders the prefill now
    ... its KV arrives (or the task ends) ──TierRelease of both leases──> unpinned

The reserve asks for a hold (TierReserve.hold): the tier gives slots only
to as many leading blocks as it can keep pinned (half its slots, less those
pinned or promised already); the rest the prefill TE reads through its own
path. Before, the blocks past that were staged all the same, committed
unpinned, and mostly evicted before the prefill TE looked (at a 16 MiB host
tier, 102k tokens staged against at most 58k taken from host): read twice.

Both leases (the lookup's, pinning the prompt's blocks already in host
memory, and the staged slots' own) are held until the prefill TE has loaded
them: released when the task's KV arrives, or when it ends (unstage), else
when they expire. The host tier is small beside the working set, and its
write-through and the other stagings would otherwise evict staged blocks
before a busy prefill TE loads them, which then reads them from storage again.

On one node the decode engine's buffer is a host-tier slot and the "stream"
to the prefill engine is its cache executor reading that slot (shared
memory, as DistFlow's shm backend does for PD's KV).

A prefill TE on another host cannot read this host's tier, so for it
(dualpath_hop "auto" with kv_stream_bytes, or "stream" for every prefill TE)
the blocks go into a buffer of this TE's worker instead and the prefill TE
pulls them a layer at a time during its forward (the paper's DE buffer ->
PE, over tcp: transfer/layer_stream.py):

    TierLookup -> TierHits -> the ON_DISK ones ──CacheOp stage_stream (rank 0:
    files -> its buffer, bucket)──> CacheOpsDone(stream: the address)
    -> seq.kv_stream (address, id, the hashes it holds) rides the PrefillOrder
    ... its KV arrives (or the task ends) -> CacheOp drop_stream (or the
    buffer's ttl) and the lookup lease released

A prefill TE with such a buffer reads ahead the same way for its own
requests (read_ahead; the paper's PE read path, storage -> PE buffer -> the
pool a layer at a time): one whose hits found no room in its pool waits for
room anyway (coordinator.py), so its disk hits are read into the buffer
meanwhile, through its own bucket, and the layered load it starts once it
has room reads them there in place (worker/layer_loads.py), not over tcp.
Without it a request's reads started only when it had room, so a pool that
holds a context or two kept the bucket idle while requests waited.

Every failure or missing answer just ends the staging: the prefill TE reads
what is left through its own path, or recomputes it; nothing waits past its
deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.sequence import Sequence
from deepserve.engine.tiers.channel import (DECODE_PATH, PREFILL_PATH, StorageQueue,
                                            TierChannel, TierEffects, lookup_below)
from deepserve.messages.cache import (DROP_STREAM, NO_SLOT, ON_DISK, STAGE_DISK,
                                      STAGE_STREAM, CacheOp, CacheOpsDone, TierCommit, TierDrop,
                                      TierHits, TierReserve, TierReserved)
from deepserve.messages.pd import KVStream


@dataclass
class _Stage:
    seq: Sequence
    hashes: list[int]  # looked up, in order
    deadline: float
    stream: bool  # into a layer stream of the worker's, not the host tier
    lookup_lease: int = 0
    disk_dir: str = ""
    lease_id: int = 0
    slots: list[int] = field(default_factory=list)
    staged: list[int] = field(default_factory=list)  # hashes of slots
    op_id: int = 0
    done: dict[int, CacheOpsDone] = field(default_factory=dict)
    read_ahead: bool = False  # this TE's own request, waiting for room (read_ahead)


class TierStaging:
    def __init__(self, kv: KVCacheManager, channel: TierChannel, storage: StorageQueue):
        self.kv, self.channel, self.storage = kv, channel, storage
        self.stages: dict[int, _Stage] = {}  # by lookup id, then reserve id, then op id
        self.held: dict[int, list[int]] = {}  # seq id -> leases held for its prefill TE
        self.streamed: set[int] = set()  # seq ids whose layer stream the worker holds
        self.reading_ahead: set[int] = set()  # seq ids whose read_ahead is under way
        self.ahead: set[int] = set()  # ... and whose read-ahead stream the worker holds
        self.hop = "auto"  # EngineConfig.dualpath_hop; streams only with stream_host
        self.stream_host = ""  # this TE's kv_bind_host when it serves layer streams

    @property
    def has_work(self) -> bool:
        return bool(self.stages)

    def streams_to(self, prefill_from: str) -> bool:
        """Whether the prefill TE at this PD address gets a layer stream."""
        if not self.stream_host:
            return False
        scheme, _, rest = prefill_from.partition("://")
        other_host = scheme == "tcp" and rest.rpartition(":")[0] != self.stream_host
        return self.hop == "stream" or other_host

    def stage(self, seq: Sequence, now: float, prefill_from: str = "") -> TierEffects:
        effects = TierEffects()
        found = lookup_below(self.kv, self.channel, seq, whole=True)  # the prefill TE's need
        if found is None:
            effects.staged.append(seq)
            return effects
        lookup = found[0]
        self.stages[lookup.lookup_id] = _Stage(seq, lookup.hashes,
                                               now + self.channel.lookup_timeout_s,
                                               self.streams_to(prefill_from))
        effects.sends.append(lookup)
        return effects

    def read_ahead(self, seq: Sequence, hashes: list[int], disk_dir: str, now: float,
                   effects: TierEffects) -> bool:
        """A request of this TE's own waits for room in its pool: read its disk
        hits (hashes) into this worker's buffer now, through this TE's bucket
        (DualPath's PE buffer), so that once it has room its layered load reads
        them there in place (ON_STREAM) instead of starting the reads only then.
        False: no buffer here, nothing to read, or a stream it has already."""
        if not self.stream_host or not hashes or seq.kv_stream is not None:
            return False
        st = _Stage(seq, hashes, now, stream=True, disk_dir=disk_dir, read_ahead=True)
        st.staged = hashes
        self.reading_ahead.add(seq.seq_id)
        self._start_op(st, now, effects, CacheOp(self.channel.next_id(), STAGE_STREAM, [],
                                                 hashes=hashes, disk_dir=disk_dir,
                                                 seq_id=seq.seq_id))
        return True

    def settle_read_ahead(self, seq: Sequence, used: bool, effects: TierEffects) -> None:
        """The request stops waiting: its layered load reads its read-ahead
        stream (used: the worker drops it after that forward), or it does not
        (dropped now, or when a read still under way ends)."""
        if not used and seq.seq_id in self.reading_ahead:
            self.reading_ahead.discard(seq.seq_id)  # abandoned: _end drops what it read
            return
        if seq.seq_id not in self.ahead:
            return
        self.ahead.discard(seq.seq_id)
        seq.kv_stream = None  # the load has its address, if it reads it
        if used:
            self.streamed.discard(seq.seq_id)
        else:
            self.unstage(seq.seq_id, effects)

    def on_hits(self, msg: TierHits, now: float, effects: TierEffects) -> bool:
        """False: not a lookup of this pipeline."""
        st = self.stages.pop(msg.lookup_id, None)
        if st is None:
            return False
        st.lookup_lease, st.disk_dir = msg.lease_id, msg.disk_dir
        disk = [h for h, s in zip(st.hashes, msg.slots) if s == ON_DISK]
        if not disk or st.seq.is_finished:
            self._end(st, effects)
            return True
        ch = self.channel
        if st.stream:  # straight into the worker's buffer: no host slots
            st.hashes = st.staged = disk
            self._start_op(st, now, effects, CacheOp(ch.next_id(), STAGE_STREAM, [],
                                                     hashes=disk, disk_dir=st.disk_dir,
                                                     seq_id=st.seq.seq_id))
            return True
        rid = ch.next_id()
        st.deadline = now + ch.lookup_timeout_s
        self.stages[rid] = st
        effects.sends.append(TierReserve(reserve_id=rid, model_key=ch.key, geometry=ch.geometry,
                                         hashes=disk, reply_to=ch.address, hold=True))
        st.hashes = disk
        return True

    def on_reserved(self, msg: TierReserved, now: float, effects: TierEffects) -> bool:
        st = self.stages.pop(msg.reserve_id, None)
        if st is None:
            return False
        pairs = [(h, s) for h, s in zip(st.hashes, msg.slots) if s != NO_SLOT]
        st.lease_id = msg.lease_id
        if not pairs or msg.error is not None:
            self._end(st, effects)
            return True
        st.staged, st.slots = [h for h, _ in pairs], [s for _, s in pairs]
        self._start_op(st, now, effects, CacheOp(self.channel.next_id(), STAGE_DISK, [],
                                                 slots=st.slots, hashes=st.staged,
                                                 segment=msg.segment, disk_dir=st.disk_dir))
        return True

    def _start_op(self, st: _Stage, now: float, effects: TierEffects, op: CacheOp) -> None:
        st.op_id = op.op_id
        self.storage.num_blocks += len(st.staged)
        st.deadline = now + self.storage.op_deadline_s()
        self.stages[st.op_id] = st
        effects.ops.append(op)

    def on_done(self, msg: CacheOpsDone, now: float, effects: TierEffects) -> bool:
        st = self.stages.get(msg.op_id)
        if st is None or st.op_id != msg.op_id:
            return False
        st.done[msg.rank] = msg
        if len(st.done) < self.channel.tp:
            return True
        del self.stages[msg.op_id]
        self.storage.num_blocks -= len(st.staged)
        first = st.done[0]  # rank 0 reads and writes whole blocks
        self.storage.bytes_read[PREFILL_PATH if st.read_ahead else DECODE_PATH] += first.nbytes
        if first.corrupt:
            effects.sends.append(TierDrop(model_key=self.channel.key, hashes=first.corrupt))
            effects.events += [("cache_block_corrupt", {"tier": "disk", "block": h})
                               for h in first.corrupt]
        if st.stream and first.num_ok and first.stream:
            self.streamed.add(st.seq.seq_id)
            if st.read_ahead:
                self.ahead.add(st.seq.seq_id)
            st.seq.kv_stream = KVStream(address=first.stream, stream_id=st.seq.seq_id,
                                        hashes=st.staged[:first.num_ok])
        self._end(st, effects, [] if st.stream else st.slots[:first.num_ok])
        return True

    def _end(self, st: _Stage, effects: TierEffects, written=()) -> None:
        if st.read_ahead:  # it waits for room in the coordinator, which looks again
            seq_id = st.seq.seq_id
            if st.seq.is_finished or seq_id not in self.reading_ahead:  # ended, or it
                st.seq.kv_stream = None  # stopped waiting (settle_read_ahead): not wanted
                self.unstage(seq_id, effects)
            self.reading_ahead.discard(seq_id)
            return
        if st.stream and st.seq.is_finished:
            self.unstage(st.seq.seq_id, effects)
        hold = bool(written) and not st.seq.is_finished
        if st.lease_id:
            effects.sends.append(TierCommit(lease_id=st.lease_id, model_key=self.channel.key,
                                            slots=list(written), hold=hold))
        if st.seq.is_finished:
            self.channel.release(st.lookup_lease, effects)
            return
        held = [lease for lease in (st.lookup_lease, st.lease_id if hold else 0) if lease]
        if held:
            self.held[st.seq.seq_id] = held
        effects.staged.append(st.seq)

    def unstage(self, seq_id: int, effects: TierEffects) -> None:
        """The task's prefill TE has what it needed (or the task ended)."""
        for lease in self.held.pop(seq_id, []):
            self.channel.release(lease, effects)
        self.ahead.discard(seq_id)
        if seq_id in self.streamed:
            self.streamed.discard(seq_id)
            effects.ops.append(CacheOp(self.channel.next_id(), DROP_STREAM, [], seq_id=seq_id))

    def poll(self, now: float, effects: TierEffects) -> None:
        for key, st in list(self.stages.items()):
            if now > st.deadline:  # no answer: order the prefill as it is
                del self.stages[key]
                if key == st.op_id:  # the copy may still run: never commit it (a stream
                    self.storage.num_blocks -= len(st.staged)  # goes by its ttl)
                    st.lease_id = 0
                self._end(st, effects)
