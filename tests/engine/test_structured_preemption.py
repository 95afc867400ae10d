"""A grammar survives preemption: with a KV pool too small for the batch,
sequences are preempted (counted) and recomputed, and every output equals
the one a roomy pool gives, and follows its grammar."""

from __future__ import annotations

import json
import re

from deepserve import LLM
from deepserve.messages.sampling import SamplingParams, StructuredOutput

PATTERN = r"(ab|ba|c){2,20}d"


def test_preempted_sequences_keep_their_grammar(tiny_model):
    prompts = [[5 + i, 9, 11 + 2 * i, 7] * 6 for i in range(6)]
    specs = [StructuredOutput(kind="regex", spec=PATTERN),
             StructuredOutput(kind="choice", spec=json.dumps(["alpha beta gamma", "delta"]))]
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured=specs[i % 2])
              for i in range(len(prompts))]
    roomy = LLM(str(tiny_model), num_kv_blocks=256, enable_prefix_caching=False)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(str(tiny_model), num_kv_blocks=8, block_size=16, enable_prefix_caching=False)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0  # the fault happened
    assert [o.token_ids for o in got] == want
    for out, p in zip(got, params):
        text = tight.tokenizer.decode(out.token_ids)
        if p.structured.kind == "regex":
            assert re.fullmatch(PATTERN, text), text
        else:
            assert text in ("alpha beta gamma", "delta"), text
