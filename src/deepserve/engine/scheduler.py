"""Continuous batching under a per-step token budget (no I/O, CPU-testable).

Each step:
  1. running sequences, decodes first, each takes min(uncomputed, budget)
     tokens (a long prompt goes in chunks across steps: chunked prefill);
     when the pool is short, the latest-arrived running sequence is
     preempted (KV dropped, recomputed later) until the allocation fits;
  2. if nothing was preempted, waiting sequences are admitted in arrival
     order while the budget, max_num_seqs and free blocks allow, each reusing
     its cached prefix.
But first, a light tenant: when a waiting sequence's tenant has nothing
running while others do, the step is theirs alone: such sequences are
admitted and nothing else runs in it (the others' decodes wait one step).
A tenant that sends little thus gets its first token as if the TE were idle
but for the step already under way, instead of sharing a step with a
flooding tenant's batch; one that keeps sequences running is not light.
Sequences without a tenant (None) are one tenant.
Where tenants compete inside a step, they share it by weight (their [tenants]
weight, which the job executor sends with each request): decodes, prefill
chunks and admissions are taken in weighted turn among the tenants,
and prefill chunks and new prompts have at most their tenant's share of the
step's tokens (engine/tenant_shares.py).
While a tenant seen in the last LIGHT_TENANT_WINDOW_S has nothing running
and another has (may_see_light_tenant), the others' steps take at most
light_step_tokens (when set: a light request waits for the step under way,
so that step is kept short), and the master schedules one step ahead
at most instead of two: a light request then waits for the step under way
only, not for one already queued behind it too (measured: B's TTFT p50
under A's flood 1.2-1.3x alone with one step, 1.65-1.75x with two;
tools/bench_tenants.py). One tenant alone, or tenants all running, keep
the deeper pipeline.
A sequence may arrive with a holder (engine/tiers/coordinator.py): a pseudo-sequence
holding the blocks a lower tier (host, disk) filled for its prefix, so they
are prefix-cache hits when it is admitted; the holder is freed then (or
when the sequence ends before that, or when the head of the queue cannot
get its blocks: holders never keep an older request from being admitted).
After the step, update() advances the sequences, publishes their computed
blocks to the prefix cache, appends sampled tokens and retires finished ones.

Asynchronous (one-step-ahead) scheduling splits update() in two:
on_dispatched(N) right after step N is sent counts its tokens as computed and
gives each sampling sequence a PLACEHOLDER token, so step N+1 can be built
while N runs (the workers put the token they sampled in N where the
placeholder is); on_sampled(N) later writes the real tokens over the
placeholders and applies stop conditions. A sequence that stops on step N's
token may already be in step N+1: that extra token is discarded.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from deepserve.engine.tenant_shares import TenantShares, weighted_order
from deepserve.messages.step import NewSeq, SampledToken, ScheduledSeq, StepBatch

LIGHT_TENANT_WINDOW_S = 10.0
"""Seconds a tenant counts as present after its last request (a light tenant
sends now and then: at 1 request/s, one is always this recent)."""


@dataclass
class SchedulerOutput:
    scheduled: dict[int, int] = field(default_factory=dict)  # seq_id -> new tokens
    seqs: dict[int, Sequence] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def to_step_batch(self, step_id: int, kv: KVCacheManager, released: list[int]) -> StepBatch:
        """The wire form for the workers; marks new sequences as known to them."""
        seqs, new = [], []
        for seq_id, num_new in self.scheduled.items():
            seq = self.seqs[seq_id]
            start = seq.num_computed_tokens
            seqs.append(ScheduledSeq(seq_id, start, seq.token_ids[start:start + num_new],
                                     list(kv.block_table(seq_id)),
                                     start + num_new == seq.num_tokens))
            if not seq.is_known_to_workers:
                seq.is_known_to_workers = True
                new.append(_new_seq(seq))
        return StepBatch(step_id, seqs, new, released)


def _new_seq(seq: Sequence) -> NewSeq:
    """The workers' first word of a sequence: with its known tokens when
    its sampler reads them (a pending PLACEHOLDER is not known yet), its
    output so far, and the stop ids its min_tokens masks."""
    new = NewSeq(seq.seq_id, seq.sampling)
    known = seq.num_tokens - seq.num_pending_tokens
    new.output_ids = seq.token_ids[seq.num_prompt_tokens:known]
    if seq.sampling.min_tokens > 0:
        new.stop_token_ids = sorted(seq.stop_token_ids)
    if seq.sampling.has_repetition_penalty:
        new.token_ids = seq.token_ids[:known]
    if seq.sampling.structured is not None and seq.sampling.structured.num_replayed:
        first = seq.num_prompt_tokens - seq.sampling.structured.num_replayed
        new.replay_ids = seq.token_ids[max(0, first):seq.num_prompt_tokens]
    return new


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, clock=time.monotonic, light_step_tokens: int = 0):
        self.kv, self.clock = kv, clock
        self.max_num_batched_tokens = max_num_batched_tokens
        self.light_step_tokens = light_step_tokens  # 0: off (module doc)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # seq_id order is arrival order
        self.num_preemptions = 0
        self.tenants_seen: dict[str | None, float] = {}  # tenant -> its last request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.tenants_seen[seq.tenant] = self.clock()

    def may_see_light_tenant(self) -> bool:
        """A tenant seen in the last LIGHT_TENANT_WINDOW_S has nothing running
        while another tenant has: its next request would be light."""
        if len(self.tenants_seen) < 2 or not self.running:
            return False  # one tenant (the usual case): one truth test per step
        since = self.clock() - LIGHT_TENANT_WINDOW_S
        self.tenants_seen = {t: at for t, at in self.tenants_seen.items() if at >= since}
        busy = {s.tenant for s in self.running}
        return any(t not in busy for t in self.tenants_seen)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stop, length or abort) and free its blocks."""
        if seq.is_finished:
            return
        if seq.num_pending_tokens:  # tokens of steps still running: discarded
            del seq.token_ids[-seq.num_pending_tokens:]
            seq.num_pending_tokens = 0
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_holder(seq)
        if self.kv.has_seq(seq.seq_id) and not seq.keep_kv:
            self.kv.free(seq.seq_id)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def adopt(self, seq: Sequence) -> None:
        """Run a sequence whose blocks the caller allocated and whose KV is in
        the pool already (a decode task whose prompt KV came from a prefill TE)."""
        assert self.kv.has_seq(seq.seq_id) and seq.status is SequenceStatus.WAITING
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    # -- schedule ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self._schedule_light(out):
            return out
        budget = self.max_num_batched_tokens
        if self.light_step_tokens and self.may_see_light_tenant():
            budget = self.light_step_tokens  # the step a light request would wait for
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_light(self, out: SchedulerOutput) -> bool:
        """A step of light tenants' waiting sequences alone; False if none got in.
        (Every step asks: with nothing waiting it costs one truth test.)"""
        if not self.waiting or not self.running:
            return False
        busy = {s.tenant for s in self.running}
        light = [s for s in self.waiting if s.tenant not in busy]
        budget = self.max_num_batched_tokens
        for seq in light:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            num_new = self._admit(seq, out, budget)
            if num_new is None:
                break
            budget -= num_new
        return not out.is_empty

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        ordered = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.seq_id))
        decodes = [s for s in ordered if s.num_uncomputed_tokens <= 1]
        prefills = weighted_order(ordered[len(decodes):])
        shares = TenantShares(prefills, max(0, budget - len(decodes)))
        for i, seq in enumerate(weighted_order(decodes) + prefills):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._is_exhausted(seq):
                continue  # preempted earlier in this loop, or awaiting its last token
            num_new = min(seq.num_uncomputed_tokens,
                          budget if i < len(decodes) else shares.cap(seq, budget))
            if num_new == 0:
                continue  # its tenant's share of the step's prefill tokens is taken
            shares.spend(seq, num_new)
            while not self.kv.grow(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = max(self.running, key=lambda s: s.seq_id)  # latest arrived
                budget += out.scheduled.pop(victim.seq_id, 0)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled[seq.seq_id], out.seqs[seq.seq_id] = num_new, seq
                budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting or budget == 0 or len(self.running) >= self.max_num_seqs:
            return  # nothing to admit: no pass over a long queue on every step
        order = weighted_order(self.waiting)
        shares = TenantShares(order, budget, lambda s: s.num_tokens - s.num_computed_tokens)
        for seq in order:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            cap = shares.cap(seq, budget)
            if cap == 0:
                continue  # its tenant's share of the step is taken
            num_new = self._admit(seq, out, cap)
            if num_new is None:  # the pool is short for the head; those that hold their
                self._admit_preloaded(out, budget)  # blocks already go round it
                break
            shares.spend(seq, num_new)
            budget -= num_new

    def _admit_preloaded(self, out: SchedulerOutput, budget: int) -> None:
        """Sequences whose blocks a layered load filled (engine/tiers/layered.py)
        need none from the pool: behind a head that waits for blocks they would
        hold theirs forever (the pool full of them, the head never admitted)."""
        for seq in [s for s in self.waiting if s.preloaded_tokens is not None]:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.kv.has_seq(seq.seq_id):
                budget -= self._admit(seq, out, budget)

    def _admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Move a waiting sequence to running with up to budget new tokens
        scheduled; their number, or None if the pool cannot take it."""
        if seq.preloaded_tokens is not None and self.kv.has_seq(seq.seq_id):
            num_cached = seq.preloaded_tokens  # a lower tier fills its own blocks, which
            num_new = min(seq.num_tokens - num_cached, budget)  # cover its prompt already
        else:
            num_cached = self.kv.num_cached_tokens(seq.token_ids, seq.salt)
            num_new = min(seq.num_tokens - num_cached, budget)
            while not self.kv.allocate(seq.seq_id, seq.token_ids, num_cached + num_new,
                                       seq.salt):
                if not self._release_holders():
                    return None
                # the holders' blocks are evictable now: try again
                num_cached = self.kv.num_cached_tokens(seq.token_ids, seq.salt)
                num_new = min(seq.num_tokens - num_cached, budget)
        self.waiting.remove(seq)
        self._free_holder(seq)
        seq.preloaded_tokens = None
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled[seq.seq_id], out.seqs[seq.seq_id] = num_new, seq
        return num_new

    def _release_holders(self) -> bool:
        """The pool is short for the head of the queue: let every waiting
        sequence's holder go (its blocks stay cached, evictable). False if
        there was none (so the caller stops: nothing more can free up)."""
        held = [seq for seq in self.waiting if seq.holder_seq_id is not None]
        for seq in held:
            self._free_holder(seq)
        return bool(held)

    def _free_holder(self, seq: Sequence) -> None:
        if seq.holder_seq_id is not None:
            if self.kv.has_seq(seq.holder_seq_id):
                self.kv.free(seq.holder_seq_id)
            seq.holder_seq_id = None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.seqs.pop(seq.seq_id, None)
        out.preempted.append(seq)

    def _is_exhausted(self, seq: Sequence) -> bool:
        """Its pending tokens already reach a length limit: nothing to schedule."""
        return (seq.num_output_tokens >= seq.sampling.max_tokens
                or seq.num_tokens >= self.max_model_len)

    # -- update --------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[Sequence]:
        """Synchronous mode: the step ran; apply it whole."""
        self.on_dispatched(out)
        return self.on_sampled(out, sampled)

    def on_dispatched(self, out: SchedulerOutput) -> None:
        """Step sent: its tokens count as computed; samplers get a placeholder."""
        for seq_id, num_new in out.scheduled.items():
            seq = out.seqs[seq_id]
            if seq.is_finished:
                continue
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending_tokens += 1

    def on_sampled(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[Sequence]:
        """Step done: publish blocks, fill placeholders, stop, publish again;
        return the sequences that got a token. Publishing first keeps the
        prompt of a request that stops at its first token (max_tokens 1, a
        context, a prefill task): its KV is computed, and cached."""
        self._commit(out)
        advanced = []
        for token in sampled:
            seq = out.seqs[token.seq_id]
            if seq.is_finished:
                continue  # aborted or stopped while the step ran
            seq.token_ids[seq.num_tokens - seq.num_pending_tokens] = token.token_id
            seq.num_pending_tokens -= 1
            if seq.sampling.logprobs is not None:
                seq.logprobs.append(token)
            if token.prompt is not None:
                seq.prompt_logprobs = token.prompt
            self.check_stop(seq, token.token_id)
            advanced.append(seq)
        self._commit(out)
        return advanced

    def _commit(self, out: SchedulerOutput) -> None:
        for seq_id in out.scheduled:
            seq = out.seqs[seq_id]
            if self.kv.has_seq(seq_id) and not seq.is_finished:
                num_known = seq.num_tokens - seq.num_pending_tokens
                self.kv.commit(seq_id, seq.token_ids, min(seq.num_computed_tokens, num_known))

    def check_stop(self, seq: Sequence, token_id: int) -> None:
        num_known = seq.num_tokens - seq.num_pending_tokens
        if token_id in seq.stop_token_ids:
            self.finish(seq, "stop")
        elif (num_known - seq.num_prompt_tokens >= seq.sampling.max_tokens
              or num_known >= self.max_model_len):
            self.finish(seq, "length")
