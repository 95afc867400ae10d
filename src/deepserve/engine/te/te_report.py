"""What a TE's master says: its TEReport to the cluster manager every report
interval, a sequence's newest token for the tokenizer, and the check that a
StepDone answers the step the master waits for."""

from __future__ import annotations

from typing import Callable

from deepserve.engine.scheduler import SchedulerOutput
from deepserve.engine.sequence import Sequence
from deepserve.ipc.sockets import PushSocket
from deepserve.messages.control import TEReport
from deepserve.messages.engine import NewTokens, StepDone


def answers(done: StepDone, step_id: int, scheduled: SchedulerOutput,
            sampling_ids: frozenset[int]) -> bool:
    """Is `done` rank 0's answer to this step? Its id, and one token or one
    failure for each sequence the step samples, except sequences finished
    already (a seq failed earlier is not reported again) and those whose
    layered load it lost (any sequence of the step, sampled or not)."""
    out = done.output
    if out.step_id != step_id:
        return False
    answered = [t.seq_id for t in out.sampled] + [f.seq_id for f in out.failed]
    if len(set(answered)) != len(answered) or not set(answered) <= sampling_ids:
        return False
    lost = {x.seq_id for x in out.lost_loads}
    if not lost <= set(scheduled.scheduled) or lost & set(answered):
        return False
    return all(scheduled.seqs[i].is_finished for i in sampling_ids.difference(answered, lost))


def remaining_tokens(seq: Sequence) -> int:
    """Load a sequence still puts on the TE: tokens to compute + tokens to generate."""
    return (seq.num_uncomputed_tokens
            + max(0, seq.sampling.max_tokens - seq.num_output_tokens))


def build_report(te_id: str, core, pd, tier, block_bytes: int = 0,
                 read_paths: dict[str, int] | None = None) -> TEReport:
    """core: the StepCore; pd: the PDCoordinator; tier: the TierLink or the
    NoTierLink (engine/tiers/link.py); block_bytes: one block's KV over all
    ranks; read_paths: the decode tasks taken so far by DualPath's read path."""
    kv, scheduler = core.kv, core.scheduler
    inserted, evicted = kv.tree.pop_events()
    transfer_bytes, transfer_seconds = pd.pop_transfer_stats()
    waiting, running = scheduler.waiting, scheduler.running
    return TEReport(
        te_id=te_id, num_waiting=len(waiting), num_running=len(running),
        load_tokens=sum(map(remaining_tokens, waiting)) + sum(map(remaining_tokens, running)),
        kv_usage=kv.usage, num_prompt_tokens=core.num_prompt_tokens,
        num_cached_tokens=core.num_cached_tokens, inserted=inserted, evicted=evicted,
        finished=core.pop_finished(), kv_transfer_bytes=transfer_bytes,
        kv_transfer_seconds=transfer_seconds,
        kv_cached_bytes=kv.tree.num_nodes * block_bytes,
        num_free_tokens=kv.num_free_blocks * kv.block_size, read_paths=read_paths or {},
        **tier.report(core.num_device_hits, kv.block_size))


class ReportLink:
    """The master's TEReport to the cluster manager (address: its inbox), one
    every interval_s."""

    def __init__(self, ctx, address: str, interval_s: float):
        self.to_cm = PushSocket(ctx, address, bind=False)
        self.interval_s, self.last_report = interval_s, 0.0

    def maybe_send(self, now: float, build: Callable[[], TEReport]) -> None:
        """Send build()'s report when the interval has passed since the last one."""
        if now - self.last_report < self.interval_s:
            return
        self.last_report = now
        self.to_cm.put(build())

    def close(self) -> None:
        self.to_cm.close()


class NoReportLink:
    """No cluster manager: nothing is built, nothing is sent."""

    def maybe_send(self, now: float, build: Callable[[], TEReport]) -> None: ...

    def close(self) -> None: ...


def new_tokens(request_id: str, seq: Sequence) -> NewTokens:
    """The sequence's newest known token (and its logprobs; with its first
    token, its prompt's) for its request."""
    num_known = seq.num_tokens - seq.num_pending_tokens
    token = seq.token_ids[num_known - 1]
    logprobs = None
    if seq.sampling.logprobs is not None:
        last = seq.logprobs[-1]
        logprobs = [(last.token_id, last.logprob, last.top or [])]
    # known tokens, not num_output_tokens: with async scheduling the next step's
    # placeholder is already appended when the first token is reported
    prompt_logprobs = seq.prompt_logprobs if num_known - seq.num_prompt_tokens == 1 else None
    return NewTokens(request_id, [token], seq.finish_reason, seq.num_cached_tokens or 0,
                     logprobs, prompt_logprobs)
