"""Does a quantized model follow its reference? Prompt logprobs of one fixed
prompt through deepserve.LLM (bf16), compared with a bound that tiny random
models meet under the kernel's int8 activations and wrong weights (a nibble
order, a zero point off) miss by nats."""

from __future__ import annotations

import numpy as np

from deepserve import LLM, SamplingParams

PROMPT = list(range(5, 200, 3))


def prompt_logprobs(model_dir, quantize: str = "") -> np.ndarray:
    llm = LLM(str(model_dir), dtype="bfloat16", quantize=quantize, num_kv_blocks=64)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        [out] = llm.generate([PROMPT], params)
        return np.array([t.logprob for t in out.prompt_logprobs])
    finally:
        llm.shutdown()


def assert_follows(reference: np.ndarray, got: np.ndarray) -> None:
    diff = np.abs(reference - got)
    assert np.median(diff) < 0.3 and abs(got.mean() / reference.mean() - 1) < 0.05, \
        (diff, reference.mean(), got.mean())
