"""The master's part of prefill/decode disaggregation (protocol: messages/pd.py).

A pure policy object, like the Scheduler: it works on the KV manager and the
scheduler it is given, reads time only from `now` arguments, opens no socket,
and answers every event with Effects that the master carries out. A TE plays
either side per request, whatever its type in the TE list:

  decode side   a request with prefill_from: allocate the prompt's blocks
                (prefix-cache hits under its salt stay; only the rest is
                ordered), send a PrefillOrder, wait for KVReady, then adopt
                the sequence (its full blocks enter the prefix tree) and
                decode it like any other.
  prefill side  a PrefillOrder: prefill with max_tokens 1; the step that
                completes the prompt carries a KVTransferOrder to the
                workers; once every rank has sent its part and the token is
                sampled, KVReady goes back. The blocks stay held until the
                KVAck, or until kv_transfer_timeout_s.

Every wait has a deadline: KV that does not arrive fails the decode task
(retryable), KV nobody acknowledges is freed. Answers echo their order's
order_id: one to an aborted or earlier attempt is acknowledged, never adopted.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

import msgspec

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.scheduler import Scheduler
from deepserve.engine.sequence import Sequence, SequenceStatus
from deepserve.messages.pd import (FailRequest, KVAck, KVEndpoint, KVReady, KVSent,
                                   KVTransferOrder, PrefillOrder)
from deepserve.messages.step import SampledToken, StepBatch

log = logging.getLogger(__name__)


@dataclass
class Effects:
    """What the master does after a PD event, in this order: send each message
    to its peer's PD address; track `started` (request id, seq: queued already);
    stream a token of each `emit` seq; fail `failed`; release `released`."""

    sends: list[tuple[str, PrefillOrder | KVReady | KVAck]] = field(default_factory=list)
    started: list[tuple[str, Sequence]] = field(default_factory=list)
    emit: list[Sequence] = field(default_factory=list)
    failed: list[FailRequest] = field(default_factory=list)
    released: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.started or self.emit or self.failed or self.released)


@dataclass
class _Awaiting:  # decode side: KV ordered (or blocked), not yet here
    request_id: str
    order_id: int
    seq: Sequence
    prefill_from: str  # the prefill master's PD address
    deadline: float


@dataclass
class _Order:  # prefill side: one PrefillOrder being served
    order: PrefillOrder
    seq: Sequence
    results: dict[int, KVSent] = field(default_factory=dict)  # rank -> its part
    token: SampledToken | None = None
    dispatched: bool = False
    held_until: float | None = None  # KVReady sent: blocks held until ack or then


class PDCoordinator:
    """address: this master's PD address (peers reply there); endpoints: one
    KVEndpoint per rank of this TE (where a prefill TE writes our KV)."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, *, te_id: str, tp: int,
                 max_model_len: int, kv_transfer_timeout_s: float, address: str,
                 endpoints: list[KVEndpoint], layerwise: bool = False, first_order_id: int = 1):
        self.kv, self.scheduler = kv, scheduler
        self.te_id, self.tp, self.max_model_len = te_id, tp, max_model_len
        self.timeout_s = kv_transfer_timeout_s
        self.address, self.endpoints, self.layerwise = address, endpoints, layerwise
        self.awaiting: dict[str, _Awaiting] = {}  # request id ->
        self.blocked: deque[str] = deque()  # awaiting, short of blocks to order into
        self.orders: dict[int, _Order] = {}  # seq id ->
        self.transfer_bytes, self.transfer_seconds = 0, []  # since the last report
        self._order_ids = itertools.count(first_order_id)

    @property
    def has_work(self) -> bool:
        """Decode tasks wait for KV (the master holds work while they do)."""
        return bool(self.awaiting)

    # -- decode side -------------------------------------------------------------
    def add_decode(self, request_id: str, seq: Sequence, prefill_from: str,
                   now: float) -> Effects:
        """seq: tracked by the master, not queued; prefill_from: a PD address."""
        self.awaiting[request_id] = _Awaiting(request_id, next(self._order_ids), seq,
                                              prefill_from, now + self.timeout_s)
        self.blocked.append(request_id)
        effects = Effects()
        self._order_blocked(effects)
        return effects

    def _order_blocked(self, effects: Effects) -> None:
        """Order KV for waiting decode tasks, oldest first, while blocks last."""
        while self.blocked:
            entry = self.awaiting.get(self.blocked[0])
            if entry is None:  # aborted or timed out while blocked
                self.blocked.popleft()
                continue
            seq = entry.seq
            if not self.kv.allocate(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.salt):
                return  # wait for blocks to free up (bounded by the deadline)
            self.blocked.popleft()
            skip = self.kv.num_shared_blocks(seq.seq_id)
            table = self.kv.block_table(seq.seq_id)
            effects.sends.append((entry.prefill_from, PrefillOrder(
                request_id=entry.request_id, order_id=entry.order_id,
                prompt_token_ids=seq.token_ids, sampling=seq.sampling, salt=seq.salt,
                skip_blocks=skip, dst_block_ids=list(table[skip:]), dst_te=self.te_id,
                dst_endpoints=self.endpoints, reply_to=self.address)))

    def on_kv_ready(self, msg: KVReady) -> Effects:
        effects = Effects()
        if msg.reply_to:  # always: whatever happens here, the prefill TE may free
            effects.sends.append((msg.reply_to, KVAck(request_id=msg.request_id,
                                                      order_id=msg.order_id)))
        entry = self.awaiting.get(msg.request_id)
        if entry is None or entry.order_id != msg.order_id:
            return effects  # aborted, timed out, or an earlier attempt's answer
        del self.awaiting[msg.request_id]
        if msg.error is not None:
            self._fail_decode(entry, f"prefill TE failed: {msg.error}", effects)
            return effects
        seq = entry.seq
        seq.token_ids.append(msg.token_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = msg.cached_tokens
        if seq.sampling.logprobs is not None:
            seq.logprobs.append(SampledToken(seq.seq_id, msg.token_id, msg.logprob, msg.top))
        self.kv.commit(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)  # RTC adopts
        self.scheduler.adopt(seq)
        self.scheduler.check_stop(seq, msg.token_id)
        effects.emit.append(seq)
        if seq.is_finished:
            effects.released.append(seq)
        return effects

    def drop_decode(self, request_id: str) -> Effects | None:
        """An abort of a decode task still waiting for its KV; None if the
        request is no such task (the master finishes it the ordinary way)."""
        entry = self.awaiting.pop(request_id, None)
        if entry is None:
            return None
        effects = Effects()
        self._free_awaiting(entry, effects)
        return effects

    def _fail_decode(self, entry: _Awaiting, message: str, effects: Effects) -> None:
        """The caller may resubmit (RETRYABLE_ERRORS): nothing was streamed yet."""
        self._free_awaiting(entry, effects)
        effects.failed.append(FailRequest(request_id=entry.request_id,
                                          error="kv_transfer_failed", message=message))

    def _free_awaiting(self, entry: _Awaiting, effects: Effects) -> None:
        entry.seq.status, entry.seq.finish_reason = SequenceStatus.FINISHED, "abort"
        if self.kv.has_seq(entry.seq.seq_id):
            self.kv.free(entry.seq.seq_id)
        effects.released.append(entry.seq)

    # -- prefill side -----------------------------------------------------------------
    def add_prefill(self, order: PrefillOrder, seq_id: int) -> Effects:
        """Queue a prefill task for the order (started), or answer it with an error."""
        effects = Effects()
        error = self._check_order(order)
        if error is not None:
            effects.sends.append((order.reply_to, KVReady(
                request_id=order.request_id, order_id=order.order_id, error=error)))
            return effects
        sampling = msgspec.structs.replace(order.sampling, max_tokens=1)
        seq = Sequence(seq_id, order.prompt_token_ids, sampling, frozenset(), order.salt)
        seq.keep_kv = True
        self.orders[seq_id] = _Order(order, seq)
        self.scheduler.add(seq)
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
            if entry is None or not s.do_sample or entry.dispatched:
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
        if entry is not None and entry.held_until is None:
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
        if entry is not None and seq.is_finished and entry.token is None:
            lp = seq.logprobs[-1] if seq.logprobs else None
            entry.token = SampledToken(seq.seq_id, seq.output_token_ids[0],
                                       lp and lp.logprob, lp and lp.top)
            self._maybe_ready(entry, now, effects)
        return effects

    def _maybe_ready(self, entry: _Order, now: float, effects: Effects) -> None:
        if entry.token is None or len(entry.results) < self.tp:
            return
        order, results = entry.order, list(entry.results.values())
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        nbytes, seconds = sum(r.nbytes for r in results), max(r.seconds for r in results)
        if errors:
            effects.sends.append((order.reply_to, KVReady(
                request_id=order.request_id, order_id=order.order_id,
                error="KV transfer failed: " + "; ".join(errors))))
            self._free_order(entry.seq.seq_id, effects)
            return
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
        for seq_id, entry in list(self.orders.items()):
            order = entry.order
            if (order.request_id == msg.request_id and order.order_id == msg.order_id
                    and entry.held_until is not None):
                self._free_order(seq_id, effects)
        return effects

    def _free_order(self, seq_id: int, effects: Effects) -> None:
        entry = self.orders.pop(seq_id)
        if self.kv.has_seq(seq_id):
            self.kv.free(seq_id)
        if not entry.seq.is_finished:  # failed before its token: stop it too
            self.scheduler.finish(entry.seq, "abort")
            effects.released.append(entry.seq)

    # -- both ---------------------------------------------------------------------------
    def poll(self, now: float) -> Effects:
        """Deadlines first (they free blocks), then orders short of blocks."""
        effects = Effects()
        for request_id, entry in list(self.awaiting.items()):
            if now > entry.deadline:
                del self.awaiting[request_id]
                self._fail_decode(entry, "the prompt's KV did not arrive from the prefill TE "
                                  f"in {self.timeout_s:g} s", effects)
        for seq_id, entry in list(self.orders.items()):
            if entry.held_until is not None and now > entry.held_until:
                log.warning("no KVAck for %s: freeing its blocks", entry.order.request_id)
                self._free_order(seq_id, effects)
        if self.blocked:
            self._order_blocked(effects)
        return effects

    def pop_transfer_stats(self) -> tuple[int, list[float]]:
        stats = (self.transfer_bytes, self.transfer_seconds)
        self.transfer_bytes, self.transfer_seconds = 0, []
        return stats
