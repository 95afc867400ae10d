"""The prefill side of PD disaggregation (protocol: messages/pd.py), pure policy.

A PrefillOrder becomes a prefill task (max_tokens 1, its KV kept): the step
that completes the prompt carries a KVTransferOrder to the workers; once
every rank has sent its part and the token is sampled, KVReady goes back.
The blocks stay held until the KVAck, or until kv_transfer_timeout_s.

An order ends in exactly one KVReady. With an error when the order is bad,
when a rank's transfer failed, when the task failed in a worker, or when the
decode TE cancelled it — and never before every rank has reported a
dispatched transfer (KVSent): the decode TE frees the destination blocks on
that KVReady, so no write of ours may still be under way then.

Prefill tasks are not requests of this TE: the master tracks them by
sequence id only (StepCore.track(..., is_request=False)), so an order never
takes the request-id slot of a request this TE serves itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.pd.effects import Effects
from deepserve.engine.scheduler import Scheduler
from deepserve.engine.sequence import Sequence
from deepserve.messages.pd import (CancelOrder, KVAck, KVReady, KVSent, KVTransferOrder,
                                   PrefillOrder)
from deepserve.messages.step import SampledToken, StepBatch

log = logging.getLogger(__name__)


@dataclass
class _Order:  # prefill side: one PrefillOrder being served
    order: PrefillOrder
    seq: Sequence
    results: dict[int, KVSent] = field(default_factory=dict)  # rank -> its part
    token: SampledToken | None = None
    dispatched: bool = False  # its transfer went to the workers: writes may be under way
    error: str | None = None  # cancelled, or failed in a worker: answered with this
    is_retryable: bool = True  # False when the request itself failed in a worker
    held_until: float | None = None  # KVReady sent: blocks held until ack or then


class PrefillSide:
    """The prefill half, held by PDCoordinator (engine/pd/coordinator.py).
    address: this master's PD address (KVReady's reply_to); timeout_s: how long
    answered blocks wait for their KVAck; enqueue: how a prefill task is queued
    (the scheduler's add, or the master's tier admission when it has tiers)."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, *, tp: int,
                 max_model_len: int, timeout_s: float, address: str, layerwise: bool = False,
                 enqueue: Callable[[Sequence], None] | None = None):
        self.kv, self.scheduler = kv, scheduler
        self.tp, self.max_model_len, self.timeout_s = tp, max_model_len, timeout_s
        self.address, self.layerwise = address, layerwise
        self.enqueue = enqueue or scheduler.add
        self.orders: dict[int, _Order] = {}  # seq id ->
        self.transfer_bytes, self.transfer_seconds = 0, []  # since the last report

    def _find(self, request_id: str, order_id: int) -> _Order | None:
        for entry in self.orders.values():
            if entry.order.request_id == request_id and entry.order.order_id == order_id:
                return entry
        return None

    def add_prefill(self, order: PrefillOrder, seq_id: int) -> Effects:
        """Queue a prefill task for the order (started), or answer it with an
        error; a duplicate of a live order is ignored."""
        effects = Effects()
        if self._find(order.request_id, order.order_id) is not None:
            log.warning("duplicate PrefillOrder %s/%d ignored", order.request_id, order.order_id)
            return effects
        error = self._check_order(order)
        if error is not None:
            effects.sends.append((order.reply_to, KVReady(
                request_id=order.request_id, order_id=order.order_id, error=error)))
            return effects
        sampling = msgspec.structs.replace(order.sampling, max_tokens=1)
        seq = Sequence(seq_id, order.prompt_token_ids, sampling, frozenset(), order.salt)
        seq.keep_kv = True
        seq.kv_stream = order.kv_stream  # hits its decode TE read for it (tiers: admit)
        self.orders[seq_id] = _Order(order, seq)
        self.enqueue(seq)
        effects.started.append((order.request_id, seq))
        return effects

    def _check_order(self, order: PrefillOrder) -> str | None:
        num_to_send = self.kv.num_blocks_for(len(order.prompt_token_ids)) - order.skip_blocks
        if len(order.dst_endpoints) != self.tp:
            return f"decode TE has {len(order.dst_endpoints)} ranks, this one {self.tp}"
        if len(order.dst_block_ids) != num_to_send:
            return f"{len(order.dst_block_ids)} destination blocks for {num_to_send} blocks to send"
        if len(order.prompt_token_ids) >= self.max_model_len:
            return f"prompt of {len(order.prompt_token_ids)} tokens is too long for this TE"
        return None

    def attach_transfers(self, batch: StepBatch) -> None:
        """Give the step that completes an ordered prompt its transfer order."""
        for s in batch.seqs:
            entry = self.orders.get(s.seq_id)
            if entry is None or not s.do_sample or entry.dispatched or entry.error:
                continue
            order = entry.order
            num_blocks = self.kv.num_blocks_for(len(order.prompt_token_ids))
            batch.transfers.append(KVTransferOrder(
                s.seq_id, order.dst_te, order.dst_endpoints,
                s.block_table[order.skip_blocks:num_blocks], order.dst_block_ids,
                self.layerwise))
            entry.dispatched = True

    def on_kv_sent(self, msg: KVSent, now: float) -> Effects:
        effects = Effects()
        entry = self.orders.get(msg.seq_id)
        if entry is not None and entry.held_until is None and entry.dispatched:
            entry.results[msg.rank] = msg
            self._maybe_ready(entry, now, effects)
        return effects

    def is_prefill(self, seq: Sequence) -> bool:
        """Its token is not streamed, nor its end reported: the decode TE does both."""
        return seq.seq_id in self.orders

    def on_first_token(self, seq: Sequence, now: float) -> Effects:
        """A finished prefill task's token: KVReady carries it (once every rank is in)."""
        effects = Effects()
        entry = self.orders.get(seq.seq_id)
        if entry is not None and seq.is_finished and entry.token is None and seq.output_token_ids:
            lp = seq.logprobs[-1] if seq.logprobs else None
            entry.token = SampledToken(seq.seq_id, seq.output_token_ids[0],
                                       lp and lp.logprob, lp and lp.top)
            self._maybe_ready(entry, now, effects)
        return effects

    def on_prefill_failed(self, seq: Sequence, message: str, retryable: bool = False
                          ) -> Effects:
        """A worker failed the task's own sampling (or its KV load: retryable):
        it ends now; the decode TE hears it in KVReady once no transfer of it
        can still be writing."""
        entry = self.orders.get(seq.seq_id)
        if entry is not None:
            entry.is_retryable = retryable
        return self._end(seq.seq_id, f"prefill failed: {message}")

    def on_cancel(self, msg: CancelOrder, now: float) -> Effects:
        """The decode TE dropped the order: stop it (a copy already answered
        and held is simply freed, as on a KVAck)."""
        entry = self._find(msg.request_id, msg.order_id)
        if entry is None:
            return Effects()
        if entry.held_until is not None:
            effects = Effects()
            self._free_order(entry.seq.seq_id, effects)
            return effects
        return self._end(entry.seq.seq_id, "cancelled")

    def _end(self, seq_id: int, error: str) -> Effects:
        """Stop the task with `error`; answer at once unless a dispatched
        transfer has ranks still to report."""
        effects = Effects()
        entry = self.orders.get(seq_id)
        if entry is None or entry.error is not None:
            return effects
        entry.error = error
        if not entry.seq.is_finished:  # its KV stays (keep_kv) until _free_order
            self.scheduler.finish(entry.seq, "abort")
            effects.released.append(entry.seq)
        self._maybe_ready(entry, 0.0, effects)
        return effects

    def _maybe_ready(self, entry: _Order, now: float, effects: Effects) -> None:
        """Answer the order (KVReady) when nothing more can come for it."""
        if entry.dispatched and len(entry.results) < self.tp:
            return  # a rank may still be writing into the decode TE's blocks
        if entry.error is None and entry.token is None:
            return
        order, results = entry.order, list(entry.results.values())
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        if not entry.dispatched and entry.error is None:
            errors = ["the KV was never sent"]  # sampled without its transfer: never adopt
        if entry.error is not None or errors:
            error = entry.error or "KV transfer failed: " + "; ".join(errors)
            effects.sends.append((order.reply_to, KVReady(
                request_id=order.request_id, order_id=order.order_id, error=error,
                is_retryable=entry.is_retryable)))
            self._free_order(entry.seq.seq_id, effects)
            return
        nbytes, seconds = sum(r.nbytes for r in results), max(r.seconds for r in results)
        self.transfer_bytes += nbytes
        self.transfer_seconds.append(seconds)
        t = entry.token
        effects.sends.append((order.reply_to, KVReady(
            request_id=order.request_id, order_id=order.order_id, token_id=t.token_id,
            logprob=t.logprob, top=t.top, cached_tokens=entry.seq.num_cached_tokens or 0,
            nbytes=nbytes, seconds=seconds, reply_to=self.address)))
        entry.held_until = now + self.timeout_s

    def on_kv_ack(self, msg: KVAck) -> Effects:
        effects = Effects()
        entry = self._find(msg.request_id, msg.order_id)
        if entry is not None and entry.held_until is not None:
            self._free_order(entry.seq.seq_id, effects)
        return effects

    def _free_order(self, seq_id: int, effects: Effects) -> None:
        entry = self.orders.pop(seq_id)
        if self.kv.has_seq(seq_id):
            self.kv.free(seq_id)
        if not entry.seq.is_finished:  # failed before its token: stop it too
            self.scheduler.finish(entry.seq, "abort")
            effects.released.append(entry.seq)

    def poll(self, now: float, effects: Effects) -> None:
        """Free the blocks of answers nobody acknowledged in time."""
        for seq_id, entry in list(self.orders.items()):
            if entry.held_until is not None and now > entry.held_until:
                log.warning("no KVAck for %s: freeing its blocks", entry.order.request_id)
                self._free_order(seq_id, effects)

    def pop_transfer_stats(self) -> tuple[int, list[float]]:
        stats = (self.transfer_bytes, self.transfer_seconds)
        self.transfer_bytes, self.transfer_seconds = 0, []
        return stats
