"""min_p, presence/frequency_penalty, logit_bias, min_tokens, bad_words_ids and
repetition_penalty in the worker's batched sampler: each against the Hugging
Face logits processor for the same setting (where HF has one), batch
independence, the pooled state's seeding and reuse, and greedy generate()
parity through deepserve.LLM on the tiny model."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper, NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper)

from deepserve import SamplingParams
from deepserve.engine.scheduler import _new_seq
from deepserve.engine.sequence import Sequence
from deepserve.worker.model_runner import is_request_error
from deepserve.worker.penalties import NONE
from deepserve.worker.sampler import SequenceTokens, sample, sanitize, warp

V = 64
NEG_INF = float("-inf")


def _p(**fields) -> SamplingParams:
    return SamplingParams(**fields).validate(V).with_defaults({})


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 4


def _ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long).reshape(1, -1)


# -- the warpers: temperature, min_p, top_k ----------------------------------------
def test_top_k_is_hf_top_k_warper_ties_included():
    logits = _logits(6)
    logits[2, 10:20] = logits[2].max() + 1.0  # ten tied for the top
    ks = [1, 2, 5, 17, V - 1, 3]
    out = warp(logits, [_p(temperature=1.0, top_k=k) for k in ks])
    for row, k in enumerate(ks):
        ref = TopKLogitsWarper(k)(_ids([]), logits[row:row + 1].clone())[0]
        assert torch.equal(out[row], ref), k
    assert int(torch.isfinite(out[2]).sum()) == 10  # k=5 keeps all ten tied


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_min_p_is_hf_min_p_after_temperature(temperature):
    logits = _logits(5, seed=1)
    min_ps = [0.01, 0.05, 0.2, 0.7, 1.0]
    out = warp(logits, [_p(temperature=temperature, min_p=m) for m in min_ps])
    for row, m in enumerate(min_ps):
        scaled = TemperatureLogitsWarper(temperature)(_ids([]), logits[row:row + 1].clone())
        assert torch.equal(out[row], MinPLogitsWarper(m)(_ids([]), scaled)[0]), m
    assert int(torch.isfinite(out[4]).sum()) == 1  # 1.0: the top token alone


# -- the processors: through SequenceTokens, step by step --------------------------
def _state(*seqs) -> SequenceTokens:
    """seqs: (params, prompt, output, stop ids) for seq ids 0, 1, ..."""
    tokens = SequenceTokens(V)
    for seq_id, (p, prompt, output, stops) in enumerate(seqs):
        tokens.add(seq_id, p, prompt + output, output, stops)
    return tokens


def _hf(processors: list[LogitsProcessor], ids: list[int], row: torch.Tensor) -> torch.Tensor:
    return LogitsProcessorList(processors)(_ids(ids), row.unsqueeze(0).clone())[0]


def test_repetition_bias_bad_words_and_min_tokens_are_hfs_processors_step_by_step():
    """One sequence with all four, as generate() orders them; the bad words'
    prefixes are in the output (vLLM reads the output only, HF the prompt too)."""
    prompt, stops = [40, 41, 42, 7], [3, 50]
    words = [[5], [7, 8], [1, 2, 3], [9, 9]]
    bias = {11: 2.5, 12: -7.0, 13: 100.0}
    p = _p(repetition_penalty=1.4, logit_bias=bias, bad_words_ids=words, min_tokens=4)
    state = _state((p, prompt, [], stops))
    hf = [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
          RepetitionPenaltyLogitsProcessor(1.4),
          NoBadWordsLogitsProcessor(words),
          MinNewTokensLengthLogitsProcessor(len(prompt), 4, stops)]
    output = []
    for step, token in enumerate([7, 1, 2, 9, 9, 3, 7]):
        logits = _logits(1, seed=step)
        out = state.process([0], [p], logits)[0]
        # The bad words' HF twin sees the output only (vLLM's rule); the rest all ids.
        ref = _hf(hf[:2], prompt + output, logits[0])
        ref = _hf(hf[2:3], output, ref)
        assert torch.equal(out, _hf(hf[3:], prompt + output, ref)), step
        assert (out[[3, 50]] == NEG_INF).tolist() == [step < 4] * 2
        assert (out[8] == NEG_INF) == (output[-1:] == [7])  # never for the prompt's 7
        output.append(token)
        state.mark([0], torch.tensor([token]))
    assert state.process([0], [p], _logits(1))[0, 8] == NEG_INF  # output ends with 7
    assert state.rules.tail[state.rules.slots[0]].tolist() == [3, 7]


def test_presence_and_frequency_are_openais_rule_over_the_output_only():
    prompt, output = [1, 1, 1, 2], [2, 5, 5, 5, 63]
    p = _p(presence_penalty=0.5, frequency_penalty=-1.25)
    state = _state((p, prompt, output, []))
    logits = _logits(1)
    logits[0, 6] = NEG_INF
    out = state.process([0], [p], logits)[0]
    ref = logits[0].clone()
    for token, count in Counter(output).items():
        ref[token] = ref[token] - (-1.25) * count - 0.5
    assert torch.equal(out, ref)  # 1 (prompt only) untouched, 6 stays masked
    state.mark([0], torch.tensor([1]))
    assert state.process([0], [p], logits)[0, 1] == logits[0, 1] + 1.25 - 0.5


def test_a_sequence_admitted_with_output_is_seeded_as_if_it_had_sampled_it():
    """A PD decode task arrives with its first token(s): counts, the min_tokens
    count and the bad words' tail start from them."""
    p = _p(repetition_penalty=1.2, presence_penalty=1.0, frequency_penalty=0.3,
           min_tokens=3, bad_words_ids=[[4, 5, 6]], logit_bias={9: 1.0})
    prompt, output = [1, 2, 3], [4, 5]
    seeded = _state((p, prompt, output, [0]))
    marked = _state((p, prompt, [], [0]))
    marked.mark([0], torch.tensor([4]))
    marked.mark([0], torch.tensor([5]))
    for step in range(3):  # outputs [4, 5], then [4, 5, 5], then [4, 5, 5, 4]
        logits = _logits(1, seed=step)
        a, b = seeded.process([0], [p], logits), marked.process([0], [p], logits)
        assert torch.equal(a, b)
        assert [bool(a[0, 6] == NEG_INF), bool(a[0, 0] == NEG_INF)] == [step == 0] * 2
        for state in (seeded, marked):
            state.mark([0], torch.tensor([5 if step == 0 else 4]))


def test_a_mixed_batch_is_each_row_alone_and_plain_rows_are_untouched():
    rows = [(_p(), [1, 2], [], []),
            (_p(logit_bias={3: -5.0}, min_tokens=2), [4], [5], [6]),
            (_p(frequency_penalty=2.0), [7], [8, 8], []),
            (_p(repetition_penalty=0.8, bad_words_ids=[[10], [11, 12]]), [9], [11], []),
            (_p(), [13], [], [])]
    state = _state(*rows)
    params = [r[0] for r in rows]
    logits = _logits(5, seed=3).to(torch.bfloat16)
    out = state.process(list(range(5)), params, logits)
    for i in range(5):
        alone = _state(rows[i]).process([0], [params[i]], logits[i:i + 1])
        assert torch.equal(out[i], sanitize(alone)[0][0]), i
    assert torch.equal(out[[0, 4]], logits[[0, 4]].float())
    assert out[3, 10] == out[3, 12] == NEG_INF and out[1, 6] == NEG_INF
    assert SequenceTokens(V).process([0], params[:1], logits) is logits  # no state: as is


def test_rows_are_dropped_reused_wiped_and_grow():
    state = SequenceTokens(V)
    p = _p(frequency_penalty=1.0, bad_words_ids=[[20, 21, 22]], min_tokens=5)
    for seq_id in range(5):  # slots and rows double: 1 -> 2 -> 4 -> 8
        state.add(seq_id, p, [], [20, 21], [0])
    assert state.rules.tail.shape == (8, 2) and len(state.counts.rows) == 5
    slot = state.rules.slots[4]
    state.drop(4)
    state.add(9, _p(logit_bias={1: 1.0}), [], [], [])  # takes the freed slot, wiped
    assert state.rules.slots[9] == slot and state.rules.tail[slot].tolist() == [NONE, NONE]
    assert int(state.rules.num_output[slot]) == 0 and 9 not in state.counts.rows
    out = state.process([9, 0], [_p(logit_bias={1: 1.0}), p], torch.zeros(2, V))
    assert out[0].nonzero().flatten().tolist() == [1] and out[1, 22] == NEG_INF
    for seq_id in (0, 1, 2, 3, 9):
        state.drop(seq_id)
    assert not (state.seen.rows or state.counts.rows or state.rules.slots)


def test_a_request_that_masks_every_token_is_its_own_error():
    p = _p(bad_words_ids=[[t] for t in range(V - 1)], min_tokens=1)
    state = _state((p, [1], [], [V - 1]))
    with pytest.raises(ValueError, match="every token is masked") as info:
        state.process([0], [p], _logits(1))
    assert is_request_error(info.value)


def test_sampled_rows_draw_from_their_own_generator_in_any_batch():
    """The batched draw: a seeded row's token is torch.multinomial's with its
    generator, whatever the other rows (greedy, other seeds, min_p, top_k)."""
    logits = _logits(4, seed=5)
    params = [_p(temperature=0.9, top_k=20, min_p=0.02, seed=1), _p(temperature=0),
              _p(temperature=1.3, top_p=0.8, seed=2), _p(temperature=0.7, min_p=0.1, seed=3)]
    for seed in range(5):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(4)]
        batch = sample(logits, params, gens)
        for i in (0, 2, 3):
            probs = torch.softmax(warp(logits[i:i + 1], [params[i]]), dim=-1)[0]
            ref = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed + i))
            assert int(batch[i]) == int(ref[0])
        assert int(batch[1]) == int(logits[1].argmax())


def test_the_runner_seeds_a_decode_task_and_fails_an_all_masking_request_alone(tiny_model):
    """Through ModelRunner: a NewSeq with one output token already (min_tokens
    2: EOS, biased to win, is masked for one more step) beside a request whose
    bad words mask the whole vocabulary (it fails alone: a request error)."""
    from deepserve.messages.step import NewSeq, ScheduledSeq, StepBatch
    from deepserve.model.loader import load_model
    from deepserve.worker.model_runner import ModelRunner

    runner = ModelRunner(load_model(str(tiny_model), "float32"), num_blocks=16, block_size=4)
    vocab, eos = runner.model.config.vocab_size, 2  # a stop id, as the master sends it
    decode = _p(temperature=0, min_tokens=2, logit_bias={eos: 100.0})
    greedy = _p(temperature=0)
    greedy.bad_words_ids = [[t] for t in range(vocab)]
    new = [NewSeq(0, decode, output_ids=[9], stop_token_ids=[eos]), NewSeq(1, greedy)]
    step = StepBatch(0, [ScheduledSeq(i, 0, [5, 6, 9], [i], True) for i in (0, 1)], new)
    first = runner.execute(step)
    assert [t.seq_id for t in first.sampled] == [0] and first.sampled[0].token_id != eos
    assert [(f.seq_id, "every token is masked" in f.message) for f in first.failed] == [(1, True)]
    token = first.sampled[0].token_id
    second = runner.execute(StepBatch(1, [ScheduledSeq(0, 3, [token], [0], True)]))
    assert [t.token_id for t in second.sampled] == [eos]  # 2 output tokens now


def test_new_seq_carries_the_output_and_the_stop_ids_min_tokens_masks():
    p = _p(min_tokens=2, stop_token_ids=[7])
    seq = Sequence(3, [1, 2, 3], p, frozenset({7, 9}))
    seq.token_ids.append(5)  # a decode task's first token, from the prefill TE
    new = _new_seq(seq)
    assert (new.output_ids, new.stop_token_ids, new.token_ids) == ([5], [7, 9], [])
    plain = _new_seq(Sequence(4, [1, 2], _p(repetition_penalty=1.1), frozenset({9})))
    assert (plain.output_ids, plain.stop_token_ids, plain.token_ids) == ([], [], [1, 2])


# -- end to end: greedy parity with transformers' generate -------------------------
class _OpenAIPenalties(LogitsProcessor):
    """presence/frequency over the output (HF has no such processor)."""

    def __init__(self, num_prompt: int, presence: float, frequency: float):
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(
            1, input_ids[:, self.num_prompt:], torch.ones_like(input_ids[:, self.num_prompt:],
                                                               dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def _hf_greedy(hf, prompt: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def test_greedy_with_the_new_fields_matches_transformers(tiny_llm, hf_models):
    """Five requests in one batch, each against generate() with HF's processors
    (presence/frequency: the OpenAI rule as a custom processor)."""
    hf = hf_models["qwen2"]
    eos = tiny_llm.engine.model_config.eos_token_ids[0]
    prompt = tiny_llm.tokenizer.encode("the the the the the the" * 3)
    plain = _hf_greedy(hf, prompt, 16)
    word = plain[3:5]  # a two-token word the plain output writes
    assert prompt[-1] != word[0] and eos not in plain and len(set(plain)) < 16  # repeats
    cases = [  # (ours, generate()'s)
        (dict(min_tokens=6, logit_bias={eos: 100.0}),  # EOS wins at once, but not before 6
         dict(min_new_tokens=6, sequence_bias={(eos,): 100.0})),
        (dict(repetition_penalty=1.3, logit_bias={plain[0]: -100.0, plain[1]: 3.0}),
         dict(repetition_penalty=1.3, sequence_bias={(plain[0],): -100.0, (plain[1],): 3.0})),
        (dict(bad_words_ids=[word, [plain[6]]]), dict(bad_words_ids=[word, [plain[6]]])),
        (dict(presence_penalty=2.0, frequency_penalty=2.0),
         dict(logits_processor=LogitsProcessorList([_OpenAIPenalties(len(prompt), 2.0, 2.0)]))),
        (dict(repetition_penalty=0.9, presence_penalty=-2.0, min_tokens=3,
              bad_words_ids=[[plain[2], plain[3]]], logit_bias={eos: 8.0}),
         dict(repetition_penalty=0.9, min_new_tokens=3, bad_words_ids=[[plain[2], plain[3]]],
              sequence_bias={(eos,): 8.0},
              logits_processor=LogitsProcessorList([_OpenAIPenalties(len(prompt), -2.0, 0.0)]))),
    ]
    refs = [_hf_greedy(hf, prompt, 16, **theirs) for _, theirs in cases]
    params = [SamplingParams(temperature=0, max_tokens=16, **ours) for ours, _ in cases]
    outs = tiny_llm.generate([prompt] * len(cases), params)
    assert [o.token_ids for o in outs] == refs
    assert len(refs[0]) == 7 and refs[0][-1] == eos and outs[0].finish_reason == "stop"
    assert all(ref != plain for ref in refs[1:])  # each setting changed the output
    assert word not in [refs[2][i:i + 2] for i in range(15)] and plain[6] not in refs[2]
