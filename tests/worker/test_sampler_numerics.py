"""The sampler on every boundary value the API accepts (issue 11: requests of
death): no NaN, a token in range with a finite logprob, and the documented
clamps exactly (tiny temperature is greedy, tiny top_p keeps the top token)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deepserve.messages.sampling import TEMPERATURE_EPSILON, SamplingParams
from deepserve.worker.sampler import LOGPROB_FLOOR, logprobs_of, sample

V = 64
NEG_INF = float("-inf")
TINY_TEMPERATURES = [0.0, 5e-324, 1e-300, 1e-45, 1e-8, TEMPERATURE_EPSILON / 2]
TEMPERATURES = TINY_TEMPERATURES + [TEMPERATURE_EPSILON, 0.3, 1.0, 2.0, 1e308]
TINY_TOP_PS = [5e-324, 1e-300, 1e-45, 1e-8]
TOP_PS = TINY_TOP_PS + [0.5, 0.999, 1.0]
TOP_KS = [-1, 0, 1, 2, V - 1, V, V + 1, 2**31, 2**63 - 1]
SEEDS = [-(2**63), -1, 0, 2**63 - 1, 2**64 - 1]
DTYPES = [torch.float32, torch.bfloat16]


def _logits(dtype: torch.dtype) -> torch.Tensor:
    """(6, V): ordinary; masked vocab; one finite logit; bf16-style overflow
    (+inf and -inf); huge finite magnitudes; ties for the top."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, V, generator=g) * 4
    rows[1, ::3] = NEG_INF
    rows[2, :] = NEG_INF
    rows[2, 17] = 1.5
    rows[3, 5], rows[3, 6], rows[3, 40:] = float("inf"), float("inf"), NEG_INF
    rows[4] = torch.linspace(-3e38, 3e38, V, dtype=torch.float64).float()
    rows[5, :] = 0.25
    rows[5, 9] = rows[5, 30] = 2.0
    return rows.to(dtype)


def _params(**fields) -> SamplingParams:
    """Valid, and resolved as a TE resolves them for a model with no defaults
    of its own: what sample() takes."""
    return SamplingParams(**fields).validate().with_defaults({})


def _gens(n: int, seed: int = 1) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed % 2**64) for _ in range(n)]


def _check(logits: torch.Tensor, tokens: torch.Tensor, num_top: int | None = 20) -> None:
    n = logits.shape[0]
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    assert bool(((tokens >= 0) & (tokens < V)).all())
    for (lp, top), tok in zip(logprobs_of(logits, tokens, [num_top] * n), tokens.tolist()):
        assert math.isfinite(lp) and LOGPROB_FLOOR <= lp <= 1e-6
        assert len(top) == min(num_top or 0, V)
        values = [v for _, v in top]
        assert all(math.isfinite(v) and LOGPROB_FLOOR <= v <= 1e-6 for v in values)
        assert values == sorted(values, reverse=True)
        assert all(0 <= t < V for t, _ in top)
        if top:
            assert top[0][1] >= lp


def test_fixture_argmax_is_what_the_rows_say():
    """The rows below are what they claim; argmax ignores -inf and ties pick the first."""
    for dtype in DTYPES:
        tokens = sample(_logits(dtype), [_params(temperature=0)] * 6, _gens(6))
        assert tokens.tolist()[2:] == [17, 5, V - 1, 9]
        assert tokens[1] % 3 != 0  # a masked token is never the argmax


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("top_p", TOP_PS)
def test_every_temperature_and_top_p_is_safe(dtype, temperature, top_p):
    logits = _logits(dtype)
    params = [_params(temperature=temperature, top_p=top_p)] * 6
    tokens = sample(logits, params, _gens(6))
    _check(logits, tokens)
    assert tokens[2] == 17  # the only finite logit always wins
    if temperature < TEMPERATURE_EPSILON or top_p in TINY_TOP_PS:
        assert tokens.tolist() == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("temperature", [1e-300, 1.0, 2.0])
def test_every_top_k_is_safe(dtype, top_k, temperature):
    logits = _logits(dtype)
    params = [_params(temperature=temperature, top_k=top_k, top_p=0.9)] * 6
    tokens = sample(logits, params, _gens(6))
    _check(logits, tokens)
    if top_k == 1:  # the top token; row 5 has two tied for it, both kept
        best = logits.float().nan_to_num(posinf=3.4e38).max(dim=-1).values
        assert torch.equal(logits.float().nan_to_num(posinf=3.4e38).gather(
            1, tokens.unsqueeze(1)).squeeze(1), best)


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_is_greedy_and_leaves_the_generator_alone(temperature):
    assert SamplingParams(temperature=temperature).is_greedy
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    gens = _gens(4)
    states = [g.get_state() for g in gens]
    tokens = sample(logits, [_params(temperature=temperature)] * 4, gens)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))


def test_temperature_epsilon_itself_samples():
    assert not SamplingParams(temperature=TEMPERATURE_EPSILON).is_greedy


@pytest.mark.parametrize("seed", SEEDS)
def test_extreme_seeds_are_reproducible(seed):
    logits = torch.zeros(1, V)  # uniform: the draw is all the generator's
    params = [_params(temperature=2.0, seed=seed)]
    first = sample(logits, params, _gens(1, seed))
    assert first.tolist() == sample(logits, params, _gens(1, seed)).tolist()
    _check(logits, first)


@pytest.mark.parametrize("num_top", [0, 1, 5, 20, V + 10])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logprobs_on_minus_inf_rows_are_floored_not_infinite(num_top, dtype):
    logits = _logits(dtype)
    tokens = torch.arange(6) * 7  # on purpose, tokens the rows make impossible
    _check(logits, tokens, num_top)
    (lp, top), = logprobs_of(logits[2:3], torch.tensor([17]), [num_top])
    assert lp == 0.0  # the one finite logit has all the mass
    assert top[:1] == ([(17, 0.0)] if num_top else [])
    assert all(v == LOGPROB_FLOOR for _, v in top[1:])
    (lp, _), = logprobs_of(logits[2:3], torch.tensor([3]), [num_top])
    assert lp == LOGPROB_FLOOR


def test_nan_and_dead_rows_still_give_a_valid_token():
    """Not a request's doing (a broken model), but still no dead worker."""
    logits = torch.randn(3, V)
    logits[0, 4] = float("nan")
    logits[1, :] = float("nan")
    logits[2, :] = NEG_INF
    for t in (0.0, 1.0):
        tokens = sample(logits, [_params(temperature=t, top_p=0.5)] * 3, _gens(3))
        _check(logits, tokens)
        assert tokens[0] != 4


def test_a_mixed_batch_of_hostile_rows_at_n_max():
    """Eight rows (n = 8, the API's max), each with other boundary values."""
    logits = torch.cat([_logits(torch.bfloat16)] * 2)[:8]
    combos = itertools.islice(itertools.product(TEMPERATURES, TOP_PS, SEEDS), 0, None, 37)
    params = [_params(temperature=t, top_p=p, seed=s, logprobs=20)
              for t, p, s in itertools.islice(combos, 8)]
    tokens = sample(logits, params, [torch.Generator().manual_seed(p.seed % 2**64)
                                     for p in params])
    _check(logits, tokens)


def _old_sample(logits, params, generators):
    """The sampler before issue 11, for ordinary values."""
    tokens = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature != 0:
            scaled = logits[row] / p.temperature
            if 0 < p.top_k < scaled.numel():
                kth = torch.topk(scaled, p.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, NEG_INF)
            if p.top_p < 1.0:
                ordered, order = torch.sort(scaled, descending=True)
                probs = torch.softmax(ordered, dim=-1)
                drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
                scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                            NEG_INF)
            tokens[row] = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen)[0]
    return tokens


@pytest.mark.parametrize("fields", [dict(temperature=0), dict(temperature=1.0),
                                    dict(temperature=0.7, top_p=0.9, top_k=50),
                                    dict(temperature=2.0, top_p=0.5), dict(temperature=1e-4)])
def test_ordinary_values_sample_exactly_as_before(fields):
    """Greedy and seeded draws on ordinary logits are token for token unchanged."""
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(5)) * 3
    params = [_params(**fields)] * 16
    for seed in range(5):
        assert (sample(logits, params, _gens(16, seed)).tolist()
                == _old_sample(logits, params, _gens(16, seed)).tolist())
