"""Weights loaded from the weight cache are the weights on disk, and a TE's
workers load from the cache when it holds the model and say so when ready."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.cache.weight_cache import ENV_VAR, WeightCache
from deepserve.model.loader import load_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_weights_from_the_cache_equal_weights_from_disk(tiny_model, tmp_path):
    entry = WeightCache(tmp_path / "cache", budget_bytes=1 << 30).ensure(tiny_model)
    assert entry is not None and entry != tiny_model
    disk = load_model(tiny_model).state_dict()
    cached = load_model(entry).state_dict()
    assert disk.keys() == cached.keys()
    for name, tensor in disk.items():
        assert torch.equal(tensor, cached[name]), name


@pytest.mark.slow  # starts two process-mode TEs
def test_te_workers_report_where_their_weights_came_from(tiny_model, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(ENV_VAR, str(root))
    outputs = {}
    for cached in (False, True):
        if cached:
            WeightCache(root, budget_bytes=1 << 30).ensure(tiny_model)
        with LLM(str(tiny_model), processes=True, tp=2, num_kv_blocks=64) as llm:
            launcher = llm.client.launcher
            outputs[cached] = llm.generate(["The cache"], GREEDY)[0].token_ids
            details = launcher.ready_details
        assert set(details) == {"tokenizer", "master", "worker0", "worker1"}
        for rank in (0, 1):
            detail = details[f"worker{rank}"]
            assert detail["weights"] == ("cache" if cached else "disk")
            assert detail["rank"] == rank and detail["load_s"] > 0 and detail["pid"] > 0
        assert 0 < launcher.spawn_s < launcher.ready_s
    assert outputs[True] == outputs[False]
