"""A TE as processes: same tokens as in-process, streaming, failures, cleanup."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from deepserve import LLM, EngineDeadError, PromptTooLongError, SamplingParams

pytestmark = pytest.mark.slow  # starts process trees

PROMPTS = ["def f(x):", "import os\n" * 12, "class A:\n    pass\n" * 6, "x", "y = [1, 2, 3]\n" * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
OPTIONS = dict(num_kv_blocks=128, max_num_batched_tokens=48, startup_timeout_s=90)


def _segments(run_id: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if run_id in p.name]


def _assert_gone(llm: LLM, pids: list[int]) -> None:
    run_id = llm.client.launcher.run_id
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert _segments(run_id) == []
    assert not llm.client.launcher.run_dir.exists()


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(str(tiny_model), num_kv_blocks=128, max_num_batched_tokens=48)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def te(tiny_model):
    llm = LLM(str(tiny_model), processes=True, **OPTIONS)
    pids = list(llm.client.launcher.pids.values())
    yield llm
    llm.shutdown()
    _assert_gone(llm, pids)


def test_process_mode_equals_in_process(te, reference):
    assert [o.token_ids for o in te.generate(PROMPTS, GREEDY)] == reference
    assert set(te.client.launcher.pids) == {"tokenizer", "master", "worker0"}


@pytest.mark.parametrize("options", [dict(async_scheduling=False), dict(tp=2)],
                         ids=["sync", "tp2"])
def test_sync_and_tp2_equal_in_process(tiny_model, reference, options):
    with LLM(str(tiny_model), processes=True, **{**OPTIONS, **options}) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_stream_increments_add_up_and_hide_split_stop_string(te):
    base = te.generate(PROMPTS[1], GREEDY)[0]
    pieces = [o.delta for o in te.stream(PROMPTS[1], GREEDY)]
    assert "".join(pieces) == base.text and len(pieces) > 3
    stop = base.text[5:9]
    stopped = [o for o in te.stream(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20,
                                                                stop=[stop]))]
    text = "".join(o.delta for o in stopped)
    assert text == base.text[:base.text.find(stop)]
    assert stopped[-1].finish_reason == "stop"
    assert all(stop not in o.delta for o in stopped)


def test_bad_input_fails_cleanly_and_te_keeps_serving(te, reference):
    with pytest.raises(PromptTooLongError):
        te.generate([[5] * 5000])
    with pytest.raises(ValueError):
        te.generate("x", SamplingParams(top_p=0))
    assert te.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[0]


@pytest.mark.parametrize("victim", ["worker0", "master", "tokenizer"])
def test_killing_any_process_fails_in_flight_requests(tiny_model, victim):
    llm = LLM(str(tiny_model), processes=True, **OPTIONS)
    pids = list(llm.client.launcher.pids.values())
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = llm.stream("def long_running():", long)
    next(stream)  # the request is running
    os.kill(llm.client.launcher.pids[victim], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=victim):
        for _ in stream:
            pass
    assert time.monotonic() - started < 15
    with pytest.raises(EngineDeadError):
        llm.generate("more", GREEDY)
    llm.shutdown()
    _assert_gone(llm, pids)
