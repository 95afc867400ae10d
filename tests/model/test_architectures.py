"""Every hf_zoo family against Hugging Face transformers: fp32 greedy, token for token.

Each shape (tests/model/hf_zoo.py) runs through the offline engine with what
a serving run turns on: prefix caching, the prompts sent twice so that the
second time their leading blocks come from the radix tree, and chunked
prefill, a step budget smaller than the longest prompt so that it is computed
in chunks attending to the earlier chunks' KV. The longest prompt is longer
than every sliding window (16 and 24 tokens), so sliding layers drop keys in
prefill chunks, in cached blocks and in decode. The oracle is transformers'
own forward on the same checkpoint (hf_zoo.hf_greedy).

A negative control shows the comparison can fail: Mistral with the window
taken out of its config.json parts from transformers (which keeps it) on the
prompts that pass 16 tokens, and agrees on the one that does not.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from deepserve import LLM, SamplingParams
from tests.model.hf_zoo import SHAPES, hf_greedy, hf_model, zoo_prompt

NEW_TOKENS = 8
PROMPTS = [zoo_prompt(1, 5), zoo_prompt(2, 21), zoo_prompt(3, 45)]
"""5 + 8 tokens stay inside every window; 45 is past all of them."""
BLOCK_SIZE = 8
ENGINE = dict(enable_prefix_caching=True, block_size=BLOCK_SIZE, num_kv_blocks=64,
              max_num_batched_tokens=20)
"""20 < 45: the long prompt is prefilled in chunks, none of them block-aligned."""
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CACHED = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS]
"""Tokens the second run finds cached: every full block but the one with the last token."""


def _generate(llm: LLM, prompts=PROMPTS) -> list:
    return llm.generate(prompts, GREEDY)


@pytest.fixture(scope="module", params=list(SHAPES))
def zoo_run(request, zoo_dirs) -> SimpleNamespace:
    """One shape: transformers' tokens, and our engine's over two runs of the prompts."""
    model_dir = zoo_dirs[request.param]
    hf = hf_model(model_dir)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(str(model_dir), **ENGINE)
    first = _generate(llm)
    hits_after_first = llm.engine.core.num_cached_tokens
    second = _generate(llm)
    return SimpleNamespace(expected=expected, first=first, second=second, llm=llm,
                           hits_after_first=hits_after_first,
                           hits_after_second=llm.engine.core.num_cached_tokens)


def test_prompts_pass_every_window_and_the_step_budget():
    windows = [f["sliding_window"] for _, f in SHAPES.values() if f.get("sliding_window")]
    assert sorted(set(windows)) == [16, 24]
    assert len(PROMPTS[0]) + NEW_TOKENS <= min(windows) < max(windows) < len(PROMPTS[-1])
    assert ENGINE["max_num_batched_tokens"] < len(PROMPTS[-1])


def test_fp32_greedy_is_transformers(zoo_run):
    assert [o.token_ids for o in zoo_run.first] == zoo_run.expected


def test_prefix_cache_hits_give_transformers_tokens(zoo_run):
    assert zoo_run.hits_after_first == 0  # the prompts share no block
    assert [o.cached_tokens for o in zoo_run.second] == CACHED
    assert zoo_run.hits_after_second - zoo_run.hits_after_first == sum(CACHED) > 0
    assert [o.token_ids for o in zoo_run.second] == zoo_run.expected


def test_kv_pool_is_whole_after_both_runs(zoo_run):
    kv = zoo_run.llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks  # every block free or evictable


def test_mistral_without_its_window_parts_from_transformers(zoo_dirs, tmp_path):
    """The negative control: same weights, sliding_window dropped from config.json."""
    model_dir = shutil.copytree(zoo_dirs["mistral-window"], tmp_path / "mistral-full")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["sliding_window"] == 16
    config["sliding_window"] = None
    (model_dir / "config.json").write_text(json.dumps(config))
    hf = hf_model(zoo_dirs["mistral-window"])
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    got = [o.token_ids for o in _generate(LLM(str(model_dir), **ENGINE))]
    assert got[0] == expected[0]  # 5 + 8 tokens: the window never drops a key
    assert got[1] != expected[1] and got[2] != expected[2]
