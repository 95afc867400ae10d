"""tools/step_timeline.py on made-up spans, and on a real TE's (slow)."""

from __future__ import annotations

import sys

import pytest

from deepserve.ipc.timeline import read_spans
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import step_timeline  # noqa: E402


def _spans(num_steps: int, batch: int) -> dict:
    """Steps 10 ms apart: forward 6 ms, sample 1, prepare 0.5; step 0 a prefill."""
    worker, master, tok = [], [], []
    for s in range(num_steps):
        t = s * 0.010
        n = 64 if s == 0 else batch
        worker += [("ring_wait", s, t - 0.001, t - 0.0005, 0), ("ring_read", s, t - 0.0005, t, 0),
                   ("prepare", s, t, t + 0.0005, 0), ("forward", s, t + 0.0005, t + 0.0065, n),
                   ("sample", s, t + 0.0065, t + 0.0075, batch),
                   ("step_done", s, t + 0.0075, t + 0.0076, 0)]
        master += [("schedule", s, t - 0.003, t - 0.002, batch),
                   ("ring_write", s, t - 0.002, t - 0.0019, 0),
                   ("collect", s, t + 0.0080, t + 0.0082, batch)]
        tok += [("detokenize", s, t + 0.0085, t + 0.0086, batch),
                ("reply", s, t + 0.0086, t + 0.0088, 0)]
    return {"te-master": master, "te-worker0": worker, "te-tokenizer": tok}


def test_decode_steps_parts_and_period():
    r = step_timeline.analyse(_spans(12, 8), 8)
    assert r["steps"] == 9  # 11 decode steps less the first and the last
    assert r["parts"]["worker/forward"] == pytest.approx(0.006)
    assert r["parts"]["master/transit"] == pytest.approx(0.0005)  # sent 7.5 ms, got 8.0
    assert r["period_s"] == pytest.approx(0.010)
    assert r["model_only_s"] == pytest.approx(0.0075)
    assert {proc for proc, *_ in r["example"]} == {"master", "worker", "tokenizer"}


def test_a_batch_size_that_never_ran_has_no_steps():
    r = step_timeline.analyse(_spans(6, 8), 4)
    assert r["steps"] == 0 and r["period_s"] is None


@pytest.mark.slow
def test_a_te_of_processes_writes_its_timeline(tiny_model, tmp_path):
    from deepserve import LLM, SamplingParams

    llm = LLM(str(tiny_model), processes=True, timeline_dir=str(tmp_path))
    try:
        prompts = [[5 + i, 6, 7, 8, 9, 10] for i in range(4)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                    ignore_eos=True))
        assert all(len(o.token_ids) == 16 for o in outs)
    finally:
        llm.shutdown()
    spans = read_spans(tmp_path)
    assert {c.rsplit("-", 1)[-1] for c in spans} == {"master", "worker0", "tokenizer"}
    r = step_timeline.analyse(spans, 4)
    assert r["steps"] >= 8
    assert all(v is not None and v >= 0 for v in r["parts"].values())
    assert r["period_s"] > 0 and r["parts"]["worker/forward"] > 0
    # a step's period covers its forward: the worker's forwards never overlap.
    # (Per step, not as medians: the period's median is over consecutive
    # pairs, the forward's over every step, and under load they can cross.)
    worker = next(v for c, v in spans.items() if c.endswith("worker0"))
    fwd = {step: (a, b) for part, step, a, b, *_ in worker if part == "forward"}
    pairs = [(fwd[s], fwd[s + 1]) for s in fwd if s + 1 in fwd]
    assert len(pairs) >= 8 and all(nxt[0] >= cur[1] for cur, nxt in pairs)
