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
