"""A worker error that belongs to one request fails that request only: the
batch's other requests complete (the same tokens as without it) and the
worker lives on; device, memory and collective errors stay fatal."""

from __future__ import annotations

import msgspec
import pytest
import torch

from deepserve import SamplingParams
from deepserve.messages.sampling import SamplingParams as Params
from deepserve.messages.step import PLACEHOLDER, NewSeq, ScheduledSeq, StepBatch
from deepserve.model.loader import load_model
from deepserve.worker import model_runner
from deepserve.worker.model_runner import ModelRunner, is_request_error

POISON_SEED = 666


@pytest.mark.parametrize("exc,is_own", [
    (ValueError("bad value"), True),
    (TypeError("'<' not supported between 'int' and 'str'"), True),
    (IndexError("index 7 is out of bounds"), True),
    (RuntimeError("shape '[3, 5]' is invalid for input of size 7"), True),
    (KeyError(12), True),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("NCCL communicator was aborted"), False),
    (RuntimeError("[../gloo/transport] Connection closed by peer"), False),
    (torch.OutOfMemoryError("CUDA out of memory"), False),
    (MemoryError(), False),
    (KeyboardInterrupt(), False),
])
def test_which_errors_are_a_requests_own(exc, is_own):
    assert is_request_error(exc) is is_own


def _poison_sample(monkeypatch):
    """The sampler raises (a request's own bad value) for any row seeded POISON_SEED."""
    real = model_runner.sample
    calls = []

    def sample(logits, params, generators, seen=None):
        calls.append(len(params))
        if any(p.seed == POISON_SEED for p in params):
            raise ValueError("poisoned sampling state")
        return real(logits, params, generators, seen)

    monkeypatch.setattr(model_runner, "sample", sample)
    return calls


@pytest.fixture(scope="module")
def runner_model(tiny_model):
    return load_model(str(tiny_model), "float32")


def _run(model, poison: bool) -> tuple[list, list]:
    """Three seqs in one batch (seq 1 poisoned if asked), then a decode step
    whose inputs are PLACEHOLDERs: (tokens of each step, failures of each)."""
    runner = ModelRunner(model, num_blocks=16, block_size=4, seed=0)
    seeds = [7, POISON_SEED if poison else 8, 9]
    new = [NewSeq(i, Params(temperature=1.0, seed=s, max_tokens=4)) for i, s in enumerate(seeds)]
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    step0 = StepBatch(0, [ScheduledSeq(i, 0, p, [i], True) for i, p in enumerate(prompts)], new)
    out0 = runner.execute(step0)
    step1 = StepBatch(1, [ScheduledSeq(i, 3, [PLACEHOLDER], [i], True) for i in range(3)])
    out1 = runner.execute(step1)
    step2 = StepBatch(2, [ScheduledSeq(i, 4, [PLACEHOLDER], [i, 3 + i], True) for i in (0, 2)],
                      finished_seq_ids=[1])
    out2 = runner.execute(step2)
    assert not runner._failed and 1 not in runner._last_sampled  # forgotten with the seq
    outs = (out0, out1, out2)
    return ([{t.seq_id: t.token_id for t in o.sampled} for o in outs],
            [[(f.seq_id, f.message) for f in o.failed] for o in outs])


def test_a_poisoned_row_fails_alone_and_the_rest_sample_as_without_it(runner_model,
                                                                      monkeypatch):
    clean, no_failures = _run(runner_model, poison=False)
    assert no_failures == [[], [], []]
    calls = _poison_sample(monkeypatch)
    tokens, failures = _run(runner_model, poison=True)
    assert failures == [[(1, "ValueError: poisoned sampling state")], [], []]  # reported once
    assert calls[:4] == [3, 1, 1, 1]  # the batch, then row by row
    assert tokens[0] == {0: clean[0][0], 2: clean[0][2]}  # seeded rows: the same draws
    assert tokens[1] == {0: clean[1][0], 2: clean[1][2]}  # never sampled again
    assert tokens[2] == clean[2]


def test_a_failed_sampling_setup_fails_that_seq_only(runner_model, monkeypatch):
    real = ModelRunner._generator

    def generator(self, p):
        if p.seed == POISON_SEED:
            raise ValueError("seed out of range")
        return real(self, p)

    monkeypatch.setattr(ModelRunner, "_generator", generator)
    tokens, failures = _run(runner_model, poison=True)
    assert failures == [[(1, "ValueError: seed out of range")], [], []]
    assert set(tokens[0]) == {0, 2} and set(tokens[1]) == {0, 2}


def test_a_device_error_in_sampling_stays_fatal(runner_model, monkeypatch):
    def sample(logits, params, generators, seen=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(model_runner, "sample", sample)
    with pytest.raises(RuntimeError, match="CUDA"):
        _run(runner_model, poison=False)


def test_in_process_engine_fails_one_request_and_finishes_the_batch(tiny_llm, monkeypatch):
    prompts = ["def f(x):", "import os", "class A:"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True)
              for s in (1, 2, 3)]
    clean = tiny_llm.generate(prompts, params)
    _poison_sample(monkeypatch)
    params[1] = msgspec.structs.replace(params[1], seed=POISON_SEED)
    outs = tiny_llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].token_ids == []
    assert [outs[i].token_ids for i in (0, 2)] == [clean[i].token_ids for i in (0, 2)]
    engine = tiny_llm.engine
    assert not engine.has_unfinished_requests() and not engine.core.seqs
    engine.kv.check_integrity()


def test_worker_step_with_the_bad_sampling_hook_reports_one_failure(runner_model, tmp_path):
    """The drill hook corrupts one request's sampling state inside a real
    worker step: its StepDone fails that seq alone, and the worker takes the
    next batch."""
    from types import SimpleNamespace

    from deepserve.faults import FaultHooks
    from deepserve.messages.engine import StepDone
    from deepserve.worker.worker_actor import _Worker
    from tests.worker.test_worker_loop import FakeOut, FakeRing

    faults = FaultHooks(tmp_path, "te/worker0", interval_s=0.0)
    faults.path("bad-sampling").write_text(f"{POISON_SEED}\n")
    worker = _Worker.__new__(_Worker)
    worker.life = SimpleNamespace(faults=faults, should_stop=lambda: False)
    worker.tp, worker.num_steps, worker.in_step = SimpleNamespace(rank=0), 0, False
    worker.decoder = msgspec.msgpack.Decoder(StepBatch)
    worker.ring, worker.out = FakeRing(), FakeOut()
    worker.runner = ModelRunner(runner_model, num_blocks=16, block_size=4, seed=0)
    new = [NewSeq(i, Params(temperature=1.0, seed=s)) for i, s in enumerate((7, POISON_SEED))]
    worker.ring.put(StepBatch(0, [ScheduledSeq(i, 0, [1, 2, 3], [i], True) for i in (0, 1)], new))
    worker.ring.put(StepBatch(1, [ScheduledSeq(i, 3, [PLACEHOLDER], [i], True) for i in (0, 1)]))
    assert worker.step() and worker.step()
    assert faults.num_fired == 1  # the fault happened
    first, second = worker.out.sent
    assert isinstance(first, StepDone) and [t.seq_id for t in first.output.sampled] == [0]
    [failure] = first.output.failed
    assert failure.seq_id == 1 and failure.message.startswith("TypeError")
    assert [t.seq_id for t in second.output.sampled] == [0] and second.output.failed == []
    assert worker.num_steps == 2
