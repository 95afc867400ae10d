"""repetition_penalty: Hugging Face's rule, batched in the worker's sampler,
checked against transformers' RepetitionPenaltyLogitsProcessor and generate()."""

from __future__ import annotations

import math

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.errors import InvalidRequestError
from deepserve.worker.sampler import SeenTokens, penalize, sample

V = 64


def _hf_penalty(penalty: float, input_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    from transformers import RepetitionPenaltyLogitsProcessor
    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([input_ids]),
                                                     logits.unsqueeze(0).clone())[0]


def _seen(histories: list[list[int]]) -> torch.Tensor:
    seen = SeenTokens(V)
    for i, ids in enumerate(histories):
        seen.add(i, ids)
    return seen.gather(list(range(len(histories))))


def test_each_row_is_what_the_hf_processor_makes_of_it():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 5  # (N, V), positive and negative
    histories = [torch.randint(0, V, (n,), generator=g).tolist() for n in (30, 1, 12, 64)]
    penalties = [1.3, 0.5, 2.0, 1.0]
    out = penalize(logits, _seen(histories), torch.tensor(penalties))
    for row, (ids, p) in enumerate(zip(histories, penalties)):
        assert torch.equal(out[row], _hf_penalty(p, ids, logits[row])), row
    assert torch.equal(out[3], logits[3])  # 1 is no penalty, bit for bit


def test_penalized_logits_stay_finite_and_masked_ones_masked():
    logits = torch.tensor([[3.0, -3.0, float("-inf"), 2.0e38, -2.0e38, 0.0]])
    seen = torch.ones_like(logits, dtype=torch.bool)
    for p in (1e-300, 1e-45, 1e300, 7.0):
        out = penalize(logits, seen, torch.tensor([p], dtype=torch.float32))
        assert bool(torch.isfinite(out[0, [0, 1, 3, 4, 5]]).all()), p
        assert out[0, 2] == float("-inf") and out[0, 5] == 0.0
    tokens = sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1e300)
                             .with_defaults({})], [torch.Generator()], seen)
    assert 0 <= int(tokens[0]) < 6 and int(tokens[0]) != 2


def test_seen_tokens_rows_are_pooled_reused_and_marked_in_one_scatter():
    seen = SeenTokens(V)
    assert seen.gather([7, 8]) is None  # nothing tracked: the sampler skips the penalty
    for seq_id in range(5):  # the pool doubles: 1 -> 2 -> 4 -> 8 rows
        seen.add(seq_id, [seq_id, seq_id + 10, V + 3, -1])  # outside the vocabulary: ignored
    assert seen.pool.shape[0] == 8 and sorted(seen.rows.values()) == [1, 2, 3, 4, 5]
    seen.mark([0, 99, 4], torch.tensor([40, 41, 42]))  # 99 is untracked: row 0 stays clear
    rows = seen.gather([0, 99, 4])
    assert [r.nonzero().flatten().tolist() for r in rows] == [[0, 10, 40], [], [4, 14, 42]]
    row_of_4 = seen.rows[4]
    seen.drop(4)
    seen.add(9, [1])  # takes the freed row, wiped
    assert seen.rows[9] == row_of_4 and seen.gather([9])[0].nonzero().flatten().tolist() == [1]
    assert not bool(seen.pool[0].any())


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1.2"])
def test_a_bad_penalty_is_a_typed_error_naming_the_field(bad):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(repetition_penalty=bad).validate()
    assert info.value.param == "repetition_penalty"


# -- end to end: greedy parity with transformers' generate ----------------------------
TEXTS = ["def f(x):\n    return x + x + x", "for i in range(3):\n    for j in range(3):\n",
         "the the the the the the"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), num_kv_blocks=256, max_num_batched_tokens=64)


def _hf_greedy(hf, prompt: list[int], penalty: float, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          repetition_penalty=penalty)
    return out[0, len(prompt):].tolist()


def test_greedy_with_a_penalty_matches_transformers_in_a_mixed_batch(llm, hf_models):
    """Penalized and plain rows share batches (chunked prefill: 64-token
    steps); a second round hits the prefix cache, whose tokens the workers
    never see in a step, and must still penalize them."""
    hf = hf_models["qwen2"]
    prompts = [llm.tokenizer.encode(t * 3) for t in TEXTS]
    cases = [(p, penalty) for p in prompts for penalty in (1.0, 1.3, 0.7)]
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=penalty)
              for _, penalty in cases]
    refs = [_hf_greedy(hf, p, penalty, 20) for p, penalty in cases]
    for round_ in range(2):
        outs = llm.generate([p for p, _ in cases], params)
        assert [o.token_ids for o in outs] == refs, round_
    assert all(o.cached_tokens > 0 for o in outs)
    assert refs[1] != refs[0]  # the penalty changed the output: the test can fail
    assert math.isclose(params[1].repetition_penalty, 1.3)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))  # carries the releases
    assert not llm.engine.runner.seen.rows  # every finished sequence let go of its row
