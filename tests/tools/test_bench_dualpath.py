"""tools/bench_dualpath.py's measures: the SLO crossing between grid rates,
the agents a held load sends, and the hit rate of the turns after the first."""

from __future__ import annotations

import asyncio

import pytest

from tests.tools.test_traces import _load

bench = _load("bench_dualpath")


def test_the_slo_crossing_is_interpolated_between_the_rates_around_it():
    assert bench.slo_crossing([(1, 5.0), (2, 10.0), (4, 30.0)], 20.0) == pytest.approx(3.0)
    assert bench.slo_crossing([(1, 5.0), (2, 20.0), (4, 30.0)], 20.0) == pytest.approx(2.0)
    # within it at every rate, or at none: no crossing on this grid
    assert bench.slo_crossing([(1, 5.0), (2, 19.9)], 20.0) is None
    assert bench.slo_crossing([(1, 25.0), (2, 30.0)], 20.0) is None
    # the first crossing counts, not a later dip back under it
    assert bench.slo_crossing([(1, 10.0), (2, 30.0), (4, 15.0), (8, 40.0)], 20.0) == \
        pytest.approx(1.5)


def test_a_held_load_sends_rate_times_window_agents():
    args = bench.parse_args(["--agents", "5", "--turns", "3", "--context", "8",
                             "--append", "2-4"])
    assert len(bench.agents(args, seed=1, rate=4.0)) == 5  # a fixed count
    args = bench.parse_args(["--agents", "5", "--window-s", "2.5", "--turns", "3",
                             "--context", "8", "--append", "2-4"])
    trace = bench.agents(args, seed=1, rate=4.0)
    assert len(trace) == 10 and len(bench.agents(args, seed=1, rate=None)) == 5
    assert all(len(a) == 3 and len(a[0]) == 8 and all(2 <= len(t) <= 4 for t in a[1:])
               for a in trace)
    assert trace == bench.agents(args, seed=1, rate=4.0)  # seeded: every mode the same


def test_later_turns_leave_out_the_first_turns_context():
    """run_agent's sums over every turn and over turns 2+, and the turns' ceiling
    (against a fake client whose replies are 2 tokens; 16-token blocks)."""
    usage = iter([(100, 0), (130, 96), (160, 112)])

    class Reply:
        def __init__(self):
            prompt, cached = next(usage)
            self.body = {"choices": [{"logprobs": {"tokens": ["token_id:7"] * 2}}],
                         "usage": {"prompt_tokens": prompt,
                                   "prompt_tokens_details": {"cached_tokens": cached}}}

        def json(self):
            return self.body

    class Client:
        async def post(self, url, json, timeout):
            return Reply()

    out = asyncio.run(bench.run_agent(Client(), "http://x", [[1] * 100, [2] * 28, [3] * 28],
                                      2, 0.0, block_size=16))
    assert out["ok"] and (out["prompt"], out["cached"]) == (390, 208)
    assert (out["prompt_later"], out["cached_later"]) == (290, 208)
    # the ceiling: the full blocks of 100 + 2 and 130 + 2 tokens, less each last one
    assert out["cacheable_later"] == 96 + 128
