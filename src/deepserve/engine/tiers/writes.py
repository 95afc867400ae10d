"""TierWrites: the tiers' write pipeline, write-through and contexts.

    new tree nodes, pinned with their ancestors ──TierReserve──> slots ──CacheOp
    store_host──> every rank's CacheOpsDone ──TierCommit──> unpinned
    a context's request, when it ends: every full block of its prompt, pinned
    for the context (TierReserve.context_id) ──store the absent──> TierCommit
    with a reply ──TierCommitted──> only then its last token is streamed
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.cache.radix_tree import RadixNode
from deepserve.engine.sequence import Sequence
from deepserve.engine.tiers.channel import TierChannel, TierEffects
from deepserve.messages.cache import (NO_SLOT, STORE_HOST, CacheOp, CacheOpsDone, TierCommit,
                                      TierCommitted, TierReserve, TierReserved)


@dataclass
class _Store:
    nodes: list[RadixNode]  # the blocks to write, in reserve order
    pinned: list[RadixNode]  # kv.pin() of them: released when done
    deadline: float
    lease_id: int = 0
    slots: list[int] = field(default_factory=list)
    op_id: int = 0
    done: dict[int, CacheOpsDone] = field(default_factory=dict)
    context: Sequence | None = None  # the context request waiting for this pin
    reserve_id: int = 0


class TierWrites:
    def __init__(self, kv: KVCacheManager, channel: TierChannel):
        self.kv, self.channel = kv, channel
        self.stores: dict[int, _Store] = {}  # by reserve id, then by op id (-reserve id: commit)

    @property
    def has_work(self) -> bool:
        return bool(self.stores)

    def write_through(self, now: float, context: Sequence | None = None,
                      nodes: list[RadixNode] | None = None) -> TierEffects:
        """Reserve host slots for the tree's new blocks (or, for a context,
        all of its prompt's full blocks, which it pins)."""
        effects, ch = TierEffects(), self.channel
        nodes = self.kv.pop_new_nodes() if nodes is None else nodes
        if not nodes and context is None:
            return effects
        store = _Store(nodes, self.kv.pin(nodes), now + ch.lookup_timeout_s, context=context)
        rid = store.reserve_id = ch.next_id()
        self.stores[rid] = store
        pin = context.pin_context if context is not None else None
        effects.sends.append(TierReserve(
            reserve_id=rid, model_key=ch.key, geometry=ch.geometry,
            hashes=[n.block_hash for n in nodes], reply_to=ch.address,
            context_id=pin.context_id if pin else None,
            expires_at=pin.expires_at if pin else 0.0, on_host=bool(pin and pin.on_host)))
        return effects

    def on_reserved(self, msg: TierReserved, now: float) -> TierEffects:
        effects = TierEffects()
        store = self.stores.pop(msg.reserve_id, None)
        if store is None:
            if msg.lease_id:  # too late: let its slots go
                effects.sends.append(TierCommit(lease_id=msg.lease_id,
                                                model_key=self.channel.key, slots=[]))
            return effects
        if msg.error is not None:
            self._end(store, effects, f"the KV tier refused: {msg.error}",
                      "context_over_budget" if msg.error == "over_budget" else None)
            return effects
        pairs = [(n.block_id, s) for n, s in zip(store.nodes, msg.slots) if s != NO_SLOT]
        store.lease_id, store.slots = msg.lease_id, [s for _, s in pairs]
        if not pairs:
            if store.context is not None:  # every block is in the tier already: pinned
                return self._commit(store, effects, now)
            self._end(store, effects)
            return effects
        store.op_id = self.channel.next_id()
        store.deadline = now + self.channel.op_timeout_s
        self.stores[store.op_id] = store
        effects.ops.append(CacheOp(store.op_id, STORE_HOST, [b for b, _ in pairs],
                                   slots=store.slots, segment=msg.segment))
        return effects

    def _commit(self, store: _Store, effects: TierEffects, now: float,
                written=()) -> TierEffects:
        needs_reply, ch = store.context is not None, self.channel
        effects.sends.append(TierCommit(lease_id=store.lease_id, model_key=ch.key,
                                        slots=list(written), reserve_id=store.reserve_id,
                                        reply_to=ch.address if needs_reply else ""))
        if needs_reply:  # the context's request ends on TierCommitted
            store.deadline = now + ch.lookup_timeout_s
            self.stores[-store.reserve_id] = store
        else:
            self.kv.unpin(store.pinned)
        return effects

    def on_committed(self, msg: TierCommitted, now: float) -> TierEffects:
        effects = TierEffects()
        store = self.stores.pop(-msg.reserve_id, None)
        if store is not None:
            self._end(store, effects, None if msg.ok else "the KV tier lost the blocks")
        return effects

    def _end(self, store: _Store, effects: TierEffects, error: str | None = None,
             code: str | None = None) -> None:
        self.kv.unpin(store.pinned)
        if store.context is not None:
            if error is None:
                effects.ended.append(store.context)
            else:
                effects.failed.append((store.context, code or "context_failed", error))

    def on_done(self, msg: CacheOpsDone, now: float, effects: TierEffects) -> None:
        store = self.stores.get(msg.op_id)
        if store is None or store.op_id != msg.op_id:
            return
        store.done[msg.rank] = msg
        if len(store.done) < self.channel.tp:
            return
        del self.stores[msg.op_id]
        ok = min(d.num_ok for d in store.done.values())
        if ok < len(store.slots) and store.context is not None:
            effects.sends.append(TierCommit(lease_id=store.lease_id, model_key=self.channel.key,
                                            slots=store.slots[:ok]))
            self._end(store, effects, "a copy to the KV tier failed")
        else:
            self._commit(store, effects, now, store.slots[:ok])

    def poll(self, now: float, effects: TierEffects) -> None:
        for key, store in list(self.stores.items()):
            if now > store.deadline:  # an unwritten slot is never committed: it lapses
                del self.stores[key]
                self._end(store, effects, "the KV tier did not answer in time")
