"""The local greedy run every cluster test compares its tokens with."""

from __future__ import annotations

import pytest

from deepserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def greedy(tiny_model):
    """ids(prompt, max_tokens): this process's own greedy tokens on the same weights."""
    llm = LLM(str(tiny_model), num_kv_blocks=256)
    cache: dict[tuple[str, int], list[int]] = {}

    def ids(prompt: str, max_tokens: int) -> list[int]:
        if (prompt, max_tokens) not in cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            cache[prompt, max_tokens] = llm.generate([prompt], params)[0].token_ids
        return cache[prompt, max_tokens]
    yield ids
    llm.shutdown()
