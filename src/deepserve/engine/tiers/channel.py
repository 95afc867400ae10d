"""What the master's tier pipelines share, passed to each of them.

    TierChannel    the tier service's key for this model, where its replies go,
                   the TE's ranks, one id counter, the deadlines
    StorageQueue   this TE's disk reads in flight and done (loads and staging
                   both add to it; the TE's report reads it)
    TierEffects    what a pipeline's event asks the master to do
    lookup_below   the TierLookup of a prompt's blocks past the device's match
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from deepserve.cache.block_hash import chain_hash, root_hash
from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.sequence import Sequence
from deepserve.messages.cache import (BlockGeometry, CacheOp, TierDrop, TierLookup,
                                      TierRelease)

PREFILL_PATH, DECODE_PATH = "prefill", "decode"


@dataclass
class TierEffects:
    """In this order: send `sends` to the tier service; attach `ops` to the
    next StepBatch; queue `ready` (scheduler.add); order the prefill of the
    `staged` decode tasks; stream `ended` contexts' last tokens (or fail them:
    `failed`, with why); log `events`."""

    sends: list = field(default_factory=list)
    ops: list[CacheOp] = field(default_factory=list)
    ready: list[Sequence] = field(default_factory=list)
    staged: list[Sequence] = field(default_factory=list)  # decode tasks: storage read for the PE
    ended: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str, str]] = field(default_factory=list)  # seq, error, why
    events: list[tuple[str, dict]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.ops or self.ready or self.staged or self.ended
                    or self.failed or self.events)


@dataclass
class TierChannel:
    """The tier service as every pipeline addresses it."""

    key: str  # the model key TEs of one model share (tier_link.model_key)
    geometry: BlockGeometry
    address: str  # where the service replies: this master's tier PULL
    tp: int  # ranks whose CacheOpsDone complete an op
    lookup_timeout_s: float = 1.0  # a lookup, reserve or commit unanswered: a miss
    op_timeout_s: float = 10.0  # a cache op not done by every rank (past its queue)
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def next_id(self) -> int:
        """Lookup, reserve and op ids: one counter, so one table may hold them all."""
        return next(self.ids)

    def release(self, lease_id: int, effects: TierEffects) -> None:
        if lease_id:
            effects.sends.append(TierRelease(lease_id=lease_id, model_key=self.key))

    def drop_corrupt(self, corrupt: list[int], effects: TierEffects) -> None:
        """Block files that failed their checks leave the tier (and are logged)."""
        if corrupt:
            effects.sends.append(TierDrop(model_key=self.key, hashes=corrupt))
        for h in corrupt:
            effects.events.append(("cache_block_corrupt", {"tier": "disk", "block": h}))


@dataclass
class StorageQueue:
    """This TE's reads from the disk tier: blocks dispatched and not done, bytes
    read per path (prefill: loads; decode: DualPath staging), its bucket's rate."""

    block_bytes: int  # one block on one rank
    tp: int
    op_timeout_s: float
    rate: float | None = None  # bytes/s of disk reads (the TE's bucket), if limited
    num_blocks: int = 0
    bytes_read: dict[str, int] = field(
        default_factory=lambda: {PREFILL_PATH: 0, DECODE_PATH: 0})  # cumulative

    def op_deadline_s(self) -> float:
        """How long an op may take: op_timeout_s past what the storage queue
        ahead of it takes at the TE's storage rate."""
        queue_bytes = self.num_blocks * self.block_bytes * self.tp
        return self.op_timeout_s + (queue_bytes / self.rate if self.rate else 0)


def lookup_below(kv: KVCacheManager, channel: TierChannel, seq: Sequence, whole: bool = False
                 ) -> tuple[TierLookup, int] | None:
    """A TierLookup of the cacheable blocks past the device's match (and how
    many the device holds; whole: of every cacheable block, for another TE);
    None when there are none to look for."""
    ids, bs = seq.token_ids, kv.block_size
    nodes = [] if whole else kv.match(ids, seq.salt)
    limit = (len(ids) - 1) // bs
    if not kv.enable_prefix_caching or len(nodes) >= limit:
        return None
    h = nodes[-1].block_hash if nodes else root_hash(seq.salt)
    hashes = []
    for i in range(len(nodes), limit):
        h = chain_hash(h, ids[i * bs:(i + 1) * bs])
        hashes.append(h)
    pin = seq.pin_context
    return TierLookup(lookup_id=channel.next_id(), model_key=channel.key,
                      geometry=channel.geometry, hashes=hashes, reply_to=channel.address,
                      is_turn_pin=pin is not None and pin.on_host), len(nodes)
