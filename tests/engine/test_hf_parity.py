"""Greedy output equals Hugging Face transformers token for token (float32)."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from tests.conftest import ARCHS

MAX_TOKENS = 24
TEXTS = [
    "def f(x):",
    "import os\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    print(i * i)\n" * 3,
    "The scheduler admits waiting requests while blocks are free. " * 4,
    "x = 1",
    "try:\n    import json\nexcept ImportError:\n    json = None\n" * 5,
    "return sorted(set(values), key=lambda v: (len(v), v))\n" * 8,
    "# comment\n",
]


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_reference(model_dirs, hf_models):
    """arch -> the oracle's greedy continuation of each prompt."""
    from deepserve.tokenizer import Tokenizer

    out = {}
    for arch in ARCHS:
        tok = Tokenizer(model_dirs[arch])
        refs = []
        for text in TEXTS:
            ids = torch.tensor([tok.encode(text)])
            with torch.no_grad():
                gen = hf_models[arch].generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
            refs.append(gen[0, ids.shape[1]:].tolist())
        out[arch] = refs
    return out


SETTINGS = {
    "prefix-cache-on": dict(enable_prefix_caching=True),
    "prefix-cache-off": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=32),
    "preemption": dict(num_kv_blocks=24, max_model_len=384, max_num_batched_tokens=128),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_matches_transformers(arch, setting, model_dirs, hf_reference):
    options = dict(num_kv_blocks=256, max_num_batched_tokens=512)
    options.update(SETTINGS[setting])
    llm = LLM(str(model_dirs[arch]), **options)
    outs = llm.generate(_prompts(llm), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for i, (out, ref) in enumerate(zip(outs, hf_reference[arch])):
        assert out.token_ids == ref, f"prompt {i} diverged"
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if setting == "chunked-prefill":
        assert max(len(p) for p in _prompts(llm)) > 32
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_hits_cache_with_same_output(arch, model_dirs, hf_models):
    llm = LLM(str(model_dirs[arch]), num_kv_blocks=256, max_num_batched_tokens=512)
    prefix = llm.tokenizer.encode("def handler(request):\n    headers = request.headers\n" * 6)
    prompts = [prefix + llm.tokenizer.encode(s) for s in ("    a = 1", "    b = 2", "    c")]
    sp = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate(prompts, sp)
    second = llm.generate(prompts, sp)
    assert len(prefix) > 64
    assert all(o.cached_tokens > 0 for o in second)
    assert all(o.cached_tokens >= (len(prefix) // 16) * 16 for o in second)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    ref = hf_models[arch].generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)
    assert second[0].token_ids == ref[0, len(prompts[0]):].tolist()
    llm.engine.kv.check_integrity()
