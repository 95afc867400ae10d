"""The master's part of prefill/decode disaggregation (protocol: messages/pd.py).

A pure policy object, like the Scheduler: it works on the KV manager and the
scheduler it is given, reads time only from `now` arguments, opens no socket,
and answers every event with Effects that the master carries out. A TE plays
either side per request, whatever its type in the TE list:

  decode side   (here) a request with prefill_from: allocate the prompt's
                blocks (prefix-cache hits under its salt stay; only the rest
                is ordered), send a PrefillOrder, wait for KVReady, then
                adopt the sequence (its full blocks enter the prefix tree)
                and decode it like any other.
  prefill side  (engine/pd/prefill.py, a PrefillSide this object holds and
                delegates to) a PrefillOrder: prefill with max_tokens 1,
                transfer, KVReady; blocks held until KVAck.

Every wait has a deadline: KV that does not arrive fails the decode task
(retryable), KV nobody acknowledges is freed. Answers echo their order's
order_id: one to an aborted or earlier attempt is acknowledged, never adopted.

A dropped order (abort, timeout) is cancelled at the prefill TE, and its
blocks stay *fenced* — allocated, owned by no request — until a KVReady of
that order says the prefill side stopped writing, or one more transfer
timeout passes: blocks a prefill TE may still write into are never handed to
another request.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.pd.effects import Effects
from deepserve.engine.pd.prefill import PrefillSide
from deepserve.engine.scheduler import Scheduler
from deepserve.engine.sequence import Sequence, SequenceStatus
from deepserve.errors import InvalidRequestError, PromptTooLongError
from deepserve.messages.pd import (CancelOrder, FailRequest, KVAck, KVEndpoint, KVReady,
                                   KVSent, PrefillOrder)
from deepserve.messages.step import SampledToken, StepBatch

log = logging.getLogger(__name__)
# a prefill TE's refusals of the request itself (KVReady.code): the caller's error
REFUSALS = frozenset({InvalidRequestError.code, PromptTooLongError.code})


@dataclass
class _Awaiting:  # decode side: KV ordered (or blocked), not yet here
    request_id: str
    order_id: int
    seq: Sequence
    prefill_from: str  # the prefill master's PD address
    deadline: float
    is_ordered: bool = False  # PrefillOrder sent: the prefill TE may write our blocks


class PDCoordinator:
    """address: this master's PD address (peers reply there); endpoints: one
    KVEndpoint per rank of this TE (where a prefill TE writes our KV); enqueue:
    how a prefill task is queued (default the scheduler's add)."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, *, te_id: str, tp: int,
                 max_model_len: int, kv_transfer_timeout_s: float, address: str,
                 endpoints: list[KVEndpoint], layerwise: bool = False, first_order_id: int = 1,
                 enqueue: Callable[[Sequence], None] | None = None):
        self.kv, self.scheduler = kv, scheduler
        self.te_id, self.tp, self.max_model_len = te_id, tp, max_model_len
        self.timeout_s = kv_transfer_timeout_s
        self.address, self.endpoints, self.layerwise = address, endpoints, layerwise
        self.awaiting: dict[str, _Awaiting] = {}  # request id ->
        self.blocked: deque[str] = deque()  # awaiting, short of blocks to order into
        self.fenced: dict[tuple[str, int], tuple[int, float]] = {}
        """(request id, order id) of a dropped order -> (seq id holding its blocks, deadline)"""
        self._order_ids = itertools.count(first_order_id)
        self.prefill = PrefillSide(kv, scheduler, tp=tp, max_model_len=max_model_len,
                                   timeout_s=kv_transfer_timeout_s, address=address,
                                   layerwise=layerwise, enqueue=enqueue)

    @property
    def has_work(self) -> bool:
        """Decode tasks wait for KV (the master holds work while they do)."""
        return bool(self.awaiting)

    @property
    def orders(self):
        """The prefill side's orders being served: seq id -> its entry."""
        return self.prefill.orders

    # -- prefill side (engine/pd/prefill.py) -----------------------------------------
    def add_prefill(self, order: PrefillOrder, seq_id: int) -> Effects:
        return self.prefill.add_prefill(order, seq_id)

    def attach_transfers(self, batch: StepBatch) -> None:
        self.prefill.attach_transfers(batch)

    def on_kv_sent(self, msg: KVSent, now: float) -> Effects:
        return self.prefill.on_kv_sent(msg, now)

    def is_prefill(self, seq: Sequence) -> bool:
        return self.prefill.is_prefill(seq)

    def on_first_token(self, seq: Sequence, now: float) -> Effects:
        return self.prefill.on_first_token(seq, now)

    def on_prefill_failed(self, seq: Sequence, message: str, retryable: bool = False
                          ) -> Effects:
        return self.prefill.on_prefill_failed(seq, message, retryable)

    def on_cancel(self, msg: CancelOrder, now: float) -> Effects:
        return self.prefill.on_cancel(msg, now)

    def on_kv_ack(self, msg: KVAck) -> Effects:
        return self.prefill.on_kv_ack(msg)

    def pop_transfer_stats(self) -> tuple[int, list[float]]:
        return self.prefill.pop_transfer_stats()

    # -- decode side -------------------------------------------------------------
    def add_decode(self, request_id: str, seq: Sequence, prefill_from: str,
                   now: float) -> Effects:
        """seq: tracked by the master, not queued; prefill_from: a PD address.
        The master drops an earlier task of the same request id first."""
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
            if entry is None or entry.is_ordered:  # gone (aborted, timed out) or replaced
                self.blocked.popleft()
                continue
            seq = entry.seq
            if not self.kv.allocate(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.salt):
                return  # wait for blocks to free up (bounded by the deadline)
            self.blocked.popleft()
            entry.is_ordered = True
            skip = self.kv.num_shared_blocks(seq.seq_id)
            table = self.kv.block_table(seq.seq_id)
            effects.sends.append((entry.prefill_from, PrefillOrder(
                request_id=entry.request_id, order_id=entry.order_id,
                prompt_token_ids=seq.token_ids, sampling=seq.sampling, salt=seq.salt,
                skip_blocks=skip, dst_block_ids=list(table[skip:]), dst_te=self.te_id,
                dst_endpoints=self.endpoints, reply_to=self.address, kv_stream=seq.kv_stream)))

    def on_kv_ready(self, msg: KVReady) -> Effects:
        effects = Effects()
        if msg.reply_to:  # whatever happens here, the prefill TE may free its copy
            effects.sends.append((msg.reply_to, KVAck(request_id=msg.request_id,
                                                      order_id=msg.order_id)))
        fence = self.fenced.pop((msg.request_id, msg.order_id), None)
        if fence is not None:  # a dropped order's answer: nothing writes its blocks now
            self._free_blocks(fence[0])
        entry = self.awaiting.get(msg.request_id)
        if entry is None or entry.order_id != msg.order_id or not entry.is_ordered:
            return effects  # aborted, timed out, or an earlier attempt's answer
        del self.awaiting[msg.request_id]
        if msg.error is not None:  # the prefill side is done: the blocks are free now
            if msg.code in REFUSALS and not msg.is_retryable:  # the caller's own request
                self._fail_decode(entry, msg.error, effects, None, msg.code)
            else:
                self._fail_decode(entry, f"prefill TE failed: {msg.error}", effects, None,
                                  "kv_transfer_failed" if msg.is_retryable else "request_failed")
            return effects
        seq = entry.seq
        seq.token_ids.append(msg.token_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens, seq.kv_from_peer = msg.cached_tokens, True
        if seq.sampling.logprobs is not None:
            seq.logprobs.append(SampledToken(seq.seq_id, msg.token_id, msg.logprob, msg.top))
        self.kv.commit(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)  # RTC adopts
        self.scheduler.adopt(seq)
        self.scheduler.check_stop(seq, msg.token_id)
        effects.emit.append(seq)
        if seq.is_finished:
            effects.released.append(seq)
        return effects

    def drop_decode(self, request_id: str, now: float) -> Effects | None:
        """An abort of a decode task still waiting for its KV; None if the
        request is no such task (the master finishes it the ordinary way)."""
        entry = self.awaiting.pop(request_id, None)
        if entry is None:
            return None
        effects = Effects()
        self._free_awaiting(entry, effects, now)
        return effects

    def _fail_decode(self, entry: _Awaiting, message: str, effects: Effects,
                     now: float | None, error: str = "kv_transfer_failed") -> None:
        """kv_transfer_failed: the caller may resubmit (RETRYABLE_ERRORS), nothing
        was streamed yet; request_failed: the request itself failed in a worker."""
        self._free_awaiting(entry, effects, now)
        effects.failed.append(FailRequest(request_id=entry.request_id, error=error,
                                          message=message))

    def _free_awaiting(self, entry: _Awaiting, effects: Effects, now: float | None) -> None:
        """End the task; its blocks are freed now, or fenced (now set and an
        order out: the prefill TE is told to stop and may still be writing)."""
        entry.seq.status, entry.seq.finish_reason = SequenceStatus.FINISHED, "abort"
        effects.released.append(entry.seq)
        if now is not None and entry.is_ordered and self.kv.has_seq(entry.seq.seq_id):
            effects.sends.append((entry.prefill_from, CancelOrder(
                request_id=entry.request_id, order_id=entry.order_id)))
            self.fenced[(entry.request_id, entry.order_id)] = (entry.seq.seq_id,
                                                               now + self.timeout_s)
        else:
            self._free_blocks(entry.seq.seq_id)

    def _free_blocks(self, seq_id: int) -> None:
        if self.kv.has_seq(seq_id):
            self.kv.free(seq_id)

    # -- both ---------------------------------------------------------------------------
    def poll(self, now: float) -> Effects:
        """Deadlines first (they free blocks), then orders short of blocks."""
        effects = Effects()
        for request_id, entry in list(self.awaiting.items()):
            if now > entry.deadline:
                del self.awaiting[request_id]
                self._fail_decode(entry, "the prompt's KV did not arrive from the prefill TE "
                                  f"in {self.timeout_s:g} s", effects, now)
        for key, (seq_id, deadline) in list(self.fenced.items()):
            if now > deadline:  # no answer to the cancel: the prefill TE is gone
                log.warning("no answer to CancelOrder %s/%d: freeing its blocks", *key)
                del self.fenced[key]
                self._free_blocks(seq_id)
        self.prefill.poll(now, effects)
        if self.blocked:
            self._order_blocked(effects)
        return effects
