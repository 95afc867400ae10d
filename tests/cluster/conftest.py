"""The local greedy run every cluster test compares its tokens with."""

from __future__ import annotations

import pytest

from deepserve import LLM
from deepserve.drill.prompts import greedy_reference


@pytest.fixture(scope="module")
def greedy(tiny_model):
    """ids(prompt, max_tokens): this process's own greedy tokens on the same weights."""
    llm = LLM(str(tiny_model), num_kv_blocks=256)
    yield greedy_reference(llm)
    llm.shutdown()
