"""The master's part of prefill/decode disaggregation (protocol: messages/pd.py).

A TE plays either side per request, whatever its type in the TE list:

  decode side   a SubmitRequest with prefill_from: allocate the prompt's
                blocks (prefix-cache hits stay, only the rest is ordered),
                send a PrefillOrder, wait for KVReady, then adopt the
                sequence (its full blocks enter this TE's prefix tree) and
                decode it like any other.
  prefill side  a PrefillOrder: prefill with max_tokens 1; the step that
                completes the prompt carries a KVTransferOrder to the
                workers; when every rank has sent its part and the first
                token is sampled, KVReady goes to the decode TE. The blocks
                stay held until its KVAck, or until kv_transfer_timeout_s.

Every wait has a deadline: a decode task whose KV does not arrive fails with
an error the caller sees; KV nobody acknowledges is freed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from deepserve.engine.sequence import Sequence, SequenceStatus
from deepserve.ipc.sockets import PushSocket
from deepserve.messages.engine import AddRequest, NewTokens, StepTokens
from deepserve.messages.pd import (FailRequest, KVAck, KVEndpoint, KVReady, KVSent,
                                   KVTransferOrder, PrefillOrder)
from deepserve.messages.step import SampledToken, StepBatch

if TYPE_CHECKING:
    from deepserve.engine.master import Master

log = logging.getLogger(__name__)


@dataclass
class _Awaiting:  # decode side: KV ordered, not yet here
    seq: Sequence
    prefill_from: str
    deadline: float
    ordered: bool = False


@dataclass
class _Order:  # prefill side: one PrefillOrder being served
    order: PrefillOrder
    seq: Sequence
    results: dict[int, KVSent] = field(default_factory=dict)  # rank -> its part
    token: SampledToken | None = None
    dispatched: bool = False
    held_until: float | None = None  # KVReady sent: blocks held until ack or then


class PDCoordinator:
    def __init__(self, master: "Master", endpoints: list[KVEndpoint]):
        self.m = master
        self.cfg = master.spec.config
        self.inbox = master.spec.tokenizer_address  # peers reach this TE's master through it
        self.endpoints = endpoints
        self.awaiting: dict[str, _Awaiting] = {}  # request id ->
        self.blocked: deque[str] = deque()  # awaiting, short of blocks to order into
        self.orders: dict[int, _Order] = {}  # seq id ->
        self.peers: dict[str, PushSocket] = {}
        self.transfer_bytes = 0
        self.transfer_seconds: list[float] = []

    # -- decode side -------------------------------------------------------------
    def add_decode(self, seq: Sequence, request_id: str, msg: AddRequest) -> None:
        deadline = time.monotonic() + self.cfg.kv_transfer_timeout_s
        self.awaiting[request_id] = _Awaiting(seq, msg.prefill_from, deadline)
        self.blocked.append(request_id)
        self._order_blocked()

    def _order_blocked(self) -> None:
        kv = self.m.kv
        while self.blocked:
            request_id = self.blocked[0]
            entry = self.awaiting.get(request_id)
            if entry is None:
                self.blocked.popleft()
                continue
            seq = entry.seq
            if not kv.allocate(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.salt):
                return  # wait for blocks to free up (bounded by the deadline)
            self.blocked.popleft()
            skip = kv.num_shared_blocks(seq.seq_id)
            table = kv.block_table(seq.seq_id)
            self._send(entry.prefill_from, PrefillOrder(
                request_id=request_id, prompt_token_ids=seq.token_ids, sampling=seq.sampling,
                salt=seq.salt, skip_blocks=skip, dst_block_ids=list(table[skip:]),
                dst_te=self.m.spec.te_id, dst_endpoints=self.endpoints, reply_to=self.inbox))
            entry.ordered = True

    def on_kv_ready(self, msg: KVReady) -> None:
        entry = self.awaiting.pop(msg.request_id, None)
        if msg.reply_to:
            self._send(msg.reply_to, KVAck(request_id=msg.request_id))
        if entry is None:
            return  # aborted or timed out meanwhile: the ack lets the prefill TE free
        seq = entry.seq
        if msg.error is not None:
            self._fail_decode(msg.request_id, entry, f"prefill TE failed: {msg.error}")
            return
        seq.token_ids.append(msg.token_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = msg.cached_tokens
        if seq.sampling.logprobs is not None:
            seq.logprobs.append(SampledToken(seq.seq_id, msg.token_id, msg.logprob, msg.top))
        self.m.kv.commit(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)  # RTC adopts
        self.m.scheduler.adopt(seq)
        self.m.scheduler.check_stop(seq, msg.token_id)
        self.m.to_tokenizer.put(StepTokens(items=[self.m.new_tokens(seq)]))
        if seq.is_finished:
            self.m.release(seq)

    def drop_decode(self, request_id: str) -> bool:
        """An abort of a decode task still waiting for its KV."""
        entry = self.awaiting.pop(request_id, None)
        if entry is None:
            return False
        self._free_awaiting(entry)
        return True

    def _fail_decode(self, request_id: str, entry: _Awaiting, message: str) -> None:
        """The caller may resubmit (RETRYABLE_ERRORS): nothing was streamed yet."""
        self._free_awaiting(entry)
        self.m.to_tokenizer.put(FailRequest(request_id=request_id, error="kv_transfer_failed",
                                            message=message))

    def _free_awaiting(self, entry: _Awaiting) -> None:
        entry.seq.status = SequenceStatus.FINISHED
        if self.m.kv.has_seq(entry.seq.seq_id):
            self.m.kv.free(entry.seq.seq_id)
        self.m.release(entry.seq)

    # -- prefill side -----------------------------------------------------------------
    def add_prefill(self, order: PrefillOrder, seq_id: int) -> Sequence | None:
        """The sequence to schedule for an order, or None (answered with an error)."""
        bs = self.cfg.block_size
        num_blocks = -(-len(order.prompt_token_ids) // bs)
        error = None
        if len(order.dst_endpoints) != self.cfg.tp:
            error = f"decode TE has {len(order.dst_endpoints)} ranks, this one {self.cfg.tp}"
        elif len(order.dst_block_ids) != num_blocks - order.skip_blocks:
            error = (f"{len(order.dst_block_ids)} destination blocks for "
                     f"{num_blocks - order.skip_blocks} blocks to send")
        elif len(order.prompt_token_ids) >= self.cfg.max_model_len:
            error = f"prompt of {len(order.prompt_token_ids)} tokens is too long for this TE"
        if error is not None:
            self._send(order.reply_to, KVReady(request_id=order.request_id, error=error))
            return None
        sampling = msgspec.structs.replace(order.sampling, max_tokens=1)
        seq = Sequence(seq_id, order.prompt_token_ids, sampling, frozenset(), order.salt)
        seq.keep_kv = True
        self.orders[seq_id] = _Order(order, seq)
        return seq

    def attach_transfers(self, batch: StepBatch) -> None:
        """Give the step that completes an ordered prompt its transfer order."""
        bs = self.cfg.block_size
        for s in batch.seqs:
            entry = self.orders.get(s.seq_id)
            if entry is None or not s.do_sample or entry.dispatched:
                continue
            order = entry.order
            num_blocks = -(-len(order.prompt_token_ids) // bs)
            batch.transfers.append(KVTransferOrder(
                s.seq_id, order.dst_te, order.dst_endpoints,
                s.block_table[order.skip_blocks:num_blocks], order.dst_block_ids,
                self.cfg.kv_transfer_layerwise))
            entry.dispatched = True

    def on_kv_sent(self, msg: KVSent) -> None:
        entry = self.orders.get(msg.seq_id)
        if entry is not None and entry.held_until is None:
            entry.results[msg.rank] = msg
            self._maybe_ready(entry)

    def on_first_token(self, seq: Sequence) -> bool:
        """A prefill task got its token; True if seq is one (the caller then
        neither streams it nor reports it finished: the decode TE does)."""
        entry = self.orders.get(seq.seq_id)
        if entry is None:
            return False
        if seq.is_finished and entry.token is None:
            tokens = seq.output_token_ids
            lp = seq.logprobs[-1] if seq.logprobs else None
            entry.token = SampledToken(seq.seq_id, tokens[0], lp and lp.logprob, lp and lp.top)
            self._maybe_ready(entry)
        return True

    def _maybe_ready(self, entry: _Order) -> None:
        if entry.token is None or len(entry.results) < self.cfg.tp:
            return
        order, results = entry.order, list(entry.results.values())
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        nbytes, seconds = sum(r.nbytes for r in results), max(r.seconds for r in results)
        if errors:
            self._send(order.reply_to, KVReady(request_id=order.request_id,
                                               error="KV transfer failed: " + "; ".join(errors)))
            self._free_order(entry.seq.seq_id)
            return
        self.transfer_bytes += nbytes
        self.transfer_seconds.append(seconds)
        t = entry.token
        self._send(order.reply_to, KVReady(
            request_id=order.request_id, token_id=t.token_id, logprob=t.logprob, top=t.top,
            cached_tokens=entry.seq.num_cached_tokens or 0, nbytes=nbytes, seconds=seconds,
            reply_to=self.inbox))
        entry.held_until = time.monotonic() + self.cfg.kv_transfer_timeout_s

    def on_kv_ack(self, msg: KVAck) -> None:
        for seq_id, entry in list(self.orders.items()):
            if entry.order.request_id == msg.request_id and entry.held_until is not None:
                self._free_order(seq_id)

    def _free_order(self, seq_id: int) -> None:
        entry = self.orders.pop(seq_id)
        if self.m.kv.has_seq(seq_id):
            self.m.kv.free(seq_id)
        if not entry.seq.is_finished:  # failed before its token: stop it too
            self.m.finish(entry.order.request_id, "abort")

    # -- both ---------------------------------------------------------------------------
    def poll(self, now: float) -> None:
        """Deadlines; retry orders short of blocks. Cheap when idle."""
        if self.blocked:
            self._order_blocked()
        for request_id, entry in list(self.awaiting.items()):
            if now > entry.deadline:
                del self.awaiting[request_id]
                self._fail_decode(request_id, entry, "the prompt's KV did not arrive from the "
                                  f"prefill TE in {self.cfg.kv_transfer_timeout_s:g} s")
        for seq_id, entry in list(self.orders.items()):
            if entry.held_until is not None and now > entry.held_until:
                log.warning("no KVAck for %s: freeing its blocks", entry.order.request_id)
                self._free_order(seq_id)

    def pop_transfer_stats(self) -> tuple[int, list[float]]:
        stats = (self.transfer_bytes, self.transfer_seconds)
        self.transfer_bytes, self.transfer_seconds = 0, []
        return stats

    def _send(self, address: str, msg) -> None:
        """To a peer TE's inbox; a peer that is gone costs at most a second
        here (the deadlines on both sides clean up after it)."""
        if address not in self.peers:
            self.peers[address] = PushSocket(self.m.ctx, address, bind=False)
        try:
            self.peers[address].put(msg, timeout=1.0)
        except TimeoutError:
            log.warning("peer %s does not take %s", address, type(msg).__name__)

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()

