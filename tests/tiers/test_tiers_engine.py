"""A process-mode TE over a real tier service: prefixes pushed out of the
device pool come back from host or disk, with the same greedy tokens."""

from __future__ import annotations

import pytest

from deepserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK_BYTES = 16 * 2048  # tiny: 2 (K, V) x 4 layers x 2 heads x 32 dims x 4 bytes per token


def prompt(seed: int, n: int = 400) -> list[int]:
    return [(seed * 97 + i * 31) % 1900 + 50 for i in range(n)]


def run(llm, prompts):
    return llm.generate(prompts, GREEDY)


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(str(tiny_model), processes=True, enable_prefix_caching=False, num_kv_blocks=128)
    try:
        yield {seed: out.token_ids
               for seed, out in zip(range(4), run(llm, [prompt(s) for s in range(4)]))}
    finally:
        llm.shutdown()


def test_evicted_prefix_comes_back_from_host(tiny_model, tier_service, reference):
    service = tier_service(host_bytes=200 * BLOCK_BYTES)
    llm = LLM(str(tiny_model), processes=True, num_kv_blocks=64, max_num_batched_tokens=512,
              tier_address=service.address, cache_cost_model=False)
    try:
        first = run(llm, [prompt(0)])[0]
        assert first.cached_tokens == 0 and first.token_ids == reference[0]
        for seed in (1, 2, 3):  # each needs 26 of the pool's 64 blocks: 0 is evicted
            run(llm, [prompt(seed)])
        again = run(llm, [prompt(0)])[0]
        assert again.cached_tokens == 384  # 24 full blocks of 25, the last token computed
        assert again.token_ids == reference[0]
        hits = service.call(lambda s: [p.index.num_valid for p in s.pools.values()])
        assert hits and hits[0] >= 4 * 24
    finally:
        llm.shutdown()
