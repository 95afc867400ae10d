"""One-step-ahead scheduling gives the same tokens as synchronous scheduling.

A fake worker stands in for the model: its next token is a function of the
whole context it holds, and, like the real workers, it resolves PLACEHOLDER
inputs with the token it sampled for that sequence in its previous step.
"""

from collections import deque

import pytest

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.scheduler import Scheduler
from deepserve.engine.sequence import PLACEHOLDER, Sequence
from deepserve.engine.te.te_report import new_tokens
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import SampledToken

STOPS = frozenset(range(13, 100, 13))  # about one token in 13 stops


class FakeWorker:
    def __init__(self):
        self.last: dict[int, int] = {}
        self.kv: dict[int, list[int]] = {}  # seq -> tokens whose "KV" it wrote

    def execute(self, out) -> list[SampledToken]:
        sampled = []
        for seq_id, num_new in out.scheduled.items():
            seq = out.seqs[seq_id]
            start = seq.num_computed_tokens
            new = [self.last[seq_id] if t == PLACEHOLDER else t
                   for t in seq.token_ids[start:start + num_new]]
            ctx = self.kv.setdefault(seq_id, [])
            del ctx[start:]
            assert len(ctx) == start
            ctx.extend(new)
            if start + num_new == seq.num_tokens:
                token = (sum(ctx) * 31 + len(ctx)) % 97 + 3
                self.last[seq_id] = token
                sampled.append(SampledToken(seq_id, token))
        return sampled


def _run(depth: int, num_blocks: int, budget: int) -> dict[int, list[int]]:
    sched = Scheduler(KVCacheManager(num_blocks, 4), budget, 8, 128)
    seqs = [Sequence(i, [(i * 7 + j) % 50 + 10 for j in range(3 + 5 * i)],
                     SamplingParams(max_tokens=6 + 3 * i), STOPS)
            for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    worker, in_flight = FakeWorker(), deque()
    while sched.has_unfinished or in_flight:
        out = sched.schedule() if len(in_flight) < depth else None
        if out is not None and not out.is_empty:
            sampled = worker.execute(out)  # runs "while" the next step is built
            sched.on_dispatched(out)
            in_flight.append((out, sampled))
            continue
        assert in_flight, "nothing scheduled and nothing running"
        sched.on_sampled(*in_flight.popleft())
        sched.kv.check_integrity()
    assert sched.kv.num_free_blocks == num_blocks
    results = {s.seq_id: (s.output_token_ids, s.finish_reason) for s in seqs}
    return results, sched.num_preemptions


@pytest.mark.parametrize("num_blocks,budget", [(64, 64), (64, 8), (14, 32)])
def test_async_equals_sync(num_blocks, budget):
    sync, num_preemptions = _run(1, num_blocks, budget)
    assert _run(2, num_blocks, budget)[0] == sync
    assert (num_preemptions > 0) == (num_blocks < 64)
    assert {reason for _, reason in sync.values()} == {"stop", "length"}
    assert all(PLACEHOLDER not in tokens for tokens, _ in sync.values())


@pytest.mark.parametrize("depth", [1, 2])
def test_prompt_logprobs_are_reported_with_the_first_token_when_a_step_is_ahead(depth):
    """The first token's report carries the prompt's logprobs, once. With a step
    ahead (depth 2) the next step's placeholder is already appended when the
    first token comes back: counting it as an output lost them on every node
    that schedules ahead (the default), and the client got prompt_logprobs []."""
    sched = Scheduler(KVCacheManager(32, 4), 64, 8, 128)
    prompt = [11, 12, 13, 14, 15]
    seq = Sequence(0, prompt, SamplingParams(max_tokens=4, prompt_logprobs=1), frozenset())
    sched.add(seq)
    entries = [(t, -1.0, []) for t in prompt[1:]]
    reports, pending_at_first, in_flight = [], None, deque()
    while sched.has_unfinished or in_flight:
        out = sched.schedule() if len(in_flight) < depth else None
        if out is not None and not out.is_empty:
            first = not in_flight and seq.num_computed_tokens == 0
            sched.on_dispatched(out)
            in_flight.append((out, [SampledToken(0, 20 + len(reports), prompt=entries
                                                 if first else None)]))
            continue
        for s in sched.on_sampled(*in_flight.popleft()):
            if not reports:
                pending_at_first = s.num_pending_tokens
            reports.append(new_tokens("r", s))
    assert pending_at_first == depth - 1  # the condition: a placeholder already appended
    assert [r.prompt_logprobs for r in reports] == [entries, None, None, None]
