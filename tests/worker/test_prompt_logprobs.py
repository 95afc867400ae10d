"""prompt_logprobs equal Hugging Face's log-softmax of the same weights at
every prompt position (fp32 tolerance), with the prompt split over several
prefill chunks, beside a request that does not ask; a repeated prompt is
computed again (no prefix-cache hit hides a position)."""

from __future__ import annotations

import torch

from deepserve import LLM
from deepserve.messages.sampling import SamplingParams


def test_prompt_logprobs_equal_hf_across_chunks(tiny_model, hf_models):
    hf = hf_models["qwen2"]
    llm = LLM(str(tiny_model), num_kv_blocks=256, max_num_batched_tokens=16)
    ids = [(7 * i + 3) % 2000 + 5 for i in range(40)]  # 40 tokens: 3 chunks of 16
    asks = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate([ids, ids[:20], ids], [asks, plain, asks])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for out in (outs[0], outs[2]):
        got = out.prompt_logprobs
        assert [t.token_id for t in got] == ids[1:]
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor([t.logprob for t in got]), want, atol=1e-4)
        for pos, t in enumerate(got):
            top = torch.topk(ref[pos], 3)
            assert [i for i, _ in t.top] == top.indices.tolist()
    assert outs[2].cached_tokens == 0  # the repeat shared no prefix
    assert outs[1].prompt_logprobs is None
    assert outs[0].token_ids == outs[2].token_ids
