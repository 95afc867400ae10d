"""A checkpoint's generation_config.json decides what a request leaves unset
(sampling defaults, max_new_tokens, a list of EOS ids), end to end through
deepserve.LLM, the TE's tokenizer process and its master; the request's own
values always win, and an unset max_tokens is the rest of the context."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepserve import LLM, SamplingParams
from deepserve.ipc.sockets import PullSocket, ipc_address
from deepserve.messages.engine import AddRequest, SubmitRequest
from deepserve.messages.pd import PrefillOrder, ToPeer, pd_address
from tests.engine.actor_harness import MasterHarness, TokenizerHarness, drain

OPTIONS = dict(num_kv_blocks=256, max_num_batched_tokens=256)


def variant(tiny_model: Path, out: Path, **generation) -> Path:
    """The tiny model (weights linked, not copied) with generation_config.json
    keys set (None deletes one)."""
    out.mkdir()
    for path in tiny_model.iterdir():
        if path.suffix == ".safetensors":
            (out / path.name).symlink_to(path)
        else:
            shutil.copy(path, out)
    config = {**json.loads((tiny_model / "generation_config.json").read_text()), **generation}
    (out / "generation_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}))
    return out


@pytest.fixture(scope="module")
def plain(tiny_model):
    return LLM(str(tiny_model), **OPTIONS)


@pytest.fixture(scope="module")
def prompt(plain) -> list[int]:
    return plain.tokenizer.encode("def f(x):")


def _ids(llm: LLM, prompt: list[int], params: SamplingParams | None = None) -> list[int]:
    return llm.generate([prompt], params)[0].token_ids


def test_an_omitted_request_is_greedy_and_stops_at_max_new_tokens(tiny_model, tmp_path, plain,
                                                                    prompt):
    llm = LLM(str(variant(tiny_model, tmp_path / "m", temperature=0.0, max_new_tokens=5)),
              **OPTIONS)
    [out] = llm.generate([prompt])  # no SamplingParams at all
    assert (len(out.token_ids), out.finish_reason) == (5, "length")
    assert out.token_ids == _ids(plain, prompt, SamplingParams(temperature=0, max_tokens=5))
    assert _ids(llm, prompt, SamplingParams(top_p=1.0)) == out.token_ids  # other fields unset
    # the request's own values win: sampled as a model without defaults samples them
    own = SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True)
    assert _ids(llm, prompt, own) == _ids(plain, prompt, own)
    assert len(_ids(llm, prompt, own)) == 9 and _ids(llm, prompt, own) != _ids(
        plain, prompt, SamplingParams(temperature=0, max_tokens=9))


@pytest.mark.parametrize("defaults,same_as", [
    (dict(top_k=1), dict(temperature=0)),  # temperature 1, but only the top token is left
    (dict(top_p=1e-9), dict(temperature=0)),
    (dict(temperature=0, repetition_penalty=1.3), dict(temperature=0, repetition_penalty=1.3)),
], ids=["top_k", "top_p", "repetition_penalty"])
def test_each_sampling_default_is_applied(tiny_model, tmp_path, plain, prompt, defaults,
                                          same_as):
    llm = LLM(str(variant(tiny_model, tmp_path / "m", **defaults)), **OPTIONS)
    unset = SamplingParams(max_tokens=16, seed=3)
    assert _ids(llm, prompt, unset) == _ids(plain, prompt, SamplingParams(max_tokens=16,
                                                                          **same_as))
    assert _ids(plain, prompt, unset) != _ids(llm, prompt, unset)  # the default mattered


def test_an_unset_max_tokens_is_the_rest_of_the_context(tiny_model, prompt):
    llm = LLM(str(tiny_model), max_model_len=40, **OPTIONS)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True))
    assert (len(out.token_ids), out.finish_reason) == (40 - len(prompt), "length")


@pytest.mark.parametrize("slot", [0, 1])
def test_every_eos_id_of_a_generation_config_list_stops(tiny_model, tmp_path, plain, prompt,
                                                        slot):
    free = _ids(plain, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    at = 6 + 4 * slot
    unused = next(t for t in range(3, 2048) if t not in free)
    assert free.index(free[at]) == at
    eos = [unused, unused]
    eos[slot] = free[at]
    llm = LLM(str(variant(tiny_model, tmp_path / "m", eos_token_id=eos)), **OPTIONS)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    assert (out.token_ids, out.finish_reason) == (free[:at + 1], "stop")


# -- where a request enters the TE ------------------------------------------------
def test_the_tokenizer_process_resolves_once_and_counts_a_resumed_output(tiny_model, tmp_path,
                                                                        short_dir):
    path = variant(tiny_model, tmp_path / "m", temperature=0.3, max_new_tokens=50)
    t = TokenizerHarness(str(path), short_dir, max_model_len=64)
    try:
        unset = SamplingParams(stop=["x"])
        t.send(SubmitRequest(request_id="a", prompt_token_ids=[5] * 10, sampling=unset))
        t.send(SubmitRequest(request_id="b", prompt_token_ids=[5] * 40, sampling=unset,
                             resumed_output_ids=30))  # an earlier attempt made 30 of the 50
        t.send(SubmitRequest(request_id="c", prompt_token_ids=[5] * 10,
                             sampling=SamplingParams(temperature=1.0, max_tokens=60)))
        a, b, c = (m.sampling for m in drain(t.master))
    finally:
        t.close()
    assert a.is_resolved and (a.temperature, a.max_tokens, a.top_k, a.stop) == (0.3, 50, 0, ["x"])
    assert b.max_tokens == 20
    assert (c.temperature, c.max_tokens) == (1.0, 60)


def test_a_decode_tes_prefill_order_carries_its_resolved_sampling(tiny_model, tmp_path,
                                                                 short_dir):
    """The prefill TE samples the first token with the decode TE's values."""
    path = variant(tiny_model, tmp_path / "m", temperature=0.0, top_k=7, max_new_tokens=9)
    m = MasterHarness(str(path), short_dir, async_scheduling=False)
    prefiller = ipc_address(short_dir, "prefiller")
    inbox = PullSocket(m.ctx, pd_address(prefiller), bind=True, type=ToPeer)
    try:
        m.send("master", AddRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                    sampling=SamplingParams(), prefill_from=prefiller))
        m.step(3)
        [order] = [x for x in drain(inbox) if isinstance(x, PrefillOrder)]
    finally:
        inbox.close()
        m.close()
    assert order.sampling.is_resolved
    assert (order.sampling.temperature, order.sampling.top_k, order.sampling.max_tokens) == (
        0.0, 7, 9)
