"""DualPath's older decode read path on one node: conf/dualpath.toml with the
decode TEs on dualpath_hop = "auto" and no stream buffer, so a decode TE
stages what it reads from storage in the host tier and its prefill TE (on
the same host) loads it from there; greedy tokens equal a colocated TE's
with every cache off. (conf/dualpath.toml itself streams:
tests/supervisor/test_node_dualpath.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from deepserve import LLM, SamplingParams
from tests.supervisor.test_node_dualpath import (OUT, ROUNDS, SESSIONS, by_path,
                                                 dualpath_config, hit_tokens, lookups, run_all,
                                                 serving, with_options)
from tests.supervisor.test_node_dualpath import \
    test_dualpath_de_fail_drill  # noqa: F401  (here: a decode TE dies while it stages)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    config = dualpath_config(tiny_model, tmp_path_factory.mktemp("storage"))
    yield from serving(with_options(config, "decode", kv_stream_bytes=0, dualpath_hop="auto"))


def test_host_staged_hits_give_the_cache_off_tokens(node, tiny_model):
    reference = LLM(str(tiny_model), enable_prefix_caching=False, num_kv_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=OUT)
    for round_ in range(ROUNDS):  # the decode path is taken when its queue is the shorter
        for prompts, outputs in asyncio.run(run_all(node.url, 100 + round_ * SESSIONS)):
            assert outputs == [o.token_ids for o in reference.generate(prompts, greedy)]
        time.sleep(1.5)  # the TEs' last reports reach the gateway
        if by_path(node.url, "deepserve_storage_read_bytes_total")["decode"] > 0:
            break
    reference.shutdown()
    assert by_path(node.url, "deepserve_storage_read_bytes_total")["decode"] > 0
    assert hit_tokens(node.url, "stream") == 0  # what decode TEs read went by the host tier
    assert hit_tokens(node.url, "host") > 0
    assert lookups(node.url, "layers_lost") == 0
