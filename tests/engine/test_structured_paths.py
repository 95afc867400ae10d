"""A grammar survives what a request goes through between processes: a PD
handoff (the prefill TE samples the first token under the grammar, the
decode TE's grammar accepts it before going on) and a resumed attempt (the
output it already streamed is in its prompt: StructuredOutput.num_replayed
tells the workers' grammar to accept it first). Both equal the colocated,
uninterrupted output token for token, and follow the grammar."""

from __future__ import annotations

import re

import msgspec
import pytest

from deepserve import LLM
from deepserve.messages.engine import SubmitRequest
from deepserve.messages.sampling import SamplingParams, StructuredOutput
from tests.engine.test_pd import PROMPTS, Pair, _ids

pytestmark = pytest.mark.slow  # starts two TEs

PATTERN = r"(ab|ba|c)+d"
GRAMMAR = SamplingParams(temperature=0.0, max_tokens=24,
                         structured=StructuredOutput(kind="regex", spec=PATTERN))


def test_pd_and_resume_keep_the_grammar(tiny_model, tmp_path):
    llm = LLM(str(tiny_model), num_kv_blocks=256)
    colocated = [o.token_ids for o in llm.generate(PROMPTS, GRAMMAR)]
    texts = [llm.tokenizer.decode(ids) for ids in colocated]
    assert all(re.fullmatch(PATTERN, t) for t in texts), texts
    pair = Pair(tiny_model, tmp_path)
    try:
        for i, prompt in enumerate(PROMPTS):
            pair.submit(f"pd{i}", prompt, GRAMMAR)
        got = _ids(pair.client, len(PROMPTS))
        assert [got[f"pd{i}"] for i in range(len(PROMPTS))] == colocated
        # Resumed after k tokens on the decode TE alone (as the gateway resumes:
        # the output so far in the prompt, max_tokens less it): the rest only.
        cuts = [min(3, len(c) - 1) for c in colocated]
        for i, (prompt, k) in enumerate(zip(PROMPTS, cuts)):
            ids = llm.tokenizer.encode(prompt) + colocated[i][:k]
            rest = msgspec.structs.replace(GRAMMAR, max_tokens=GRAMMAR.max_tokens - k)
            pair.to_d.put(SubmitRequest(request_id=f"re{i}", prompt_token_ids=ids,
                                        sampling=rest, reply_to=pair.reply, attempt=1,
                                        resumed_output_ids=k))
        resumed = _ids(pair.client, len(PROMPTS))
        assert [resumed[f"re{i}"] for i in range(len(PROMPTS))] == [
            c[k:] for c, k in zip(colocated, cuts)]
    finally:
        pair.close()
