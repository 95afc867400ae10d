"""DualPath's decode read path as a layer stream, end to end on one node:
conf/dualpath.toml with the decode TEs streaming to every prefill TE
(dualpath_hop = "stream", what they do for prefill TEs on other hosts:
tests/cluster/test_dualpath_hosts.py runs that). The blocks a decode TE
reads from storage stay in its worker's buffer and the prefill TE pulls them
a layer at a time over tcp; greedy tokens equal a colocated TE's with every
cache off."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from deepserve import LLM, SamplingParams
from deepserve.supervisor.node import Node
from tests.supervisor.test_node import _shm
from tests.supervisor.test_node_dualpath import (OUT, ROUNDS, SESSIONS, by_path,
                                                 dualpath_config, hit_tokens, lookups, run_all)
from tests.supervisor.test_node_dualpath import \
    test_dualpath_de_fail_drill  # noqa: F401  (here: a decode TE dies while it fills a stream)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    config = dualpath_config(tiny_model, tmp_path_factory.mktemp("storage"))
    tes = tuple(msgspec.structs.replace(te, options={
        **te.options, "kv_stream_bytes": 32 << 20, "dualpath_hop": "stream"})
        if te.te_type == "decode" else te for te in config.tes)
    node = Node(msgspec.structs.replace(config, tes=tes))
    node.start()
    yield node
    node.stop()
    assert _shm(node) == set()


def test_streamed_hits_give_the_cache_off_tokens(node, tiny_model):
    reference = LLM(str(tiny_model), enable_prefix_caching=False, num_kv_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=OUT)
    for round_ in range(ROUNDS):  # the decode path is taken when its queue is the shorter
        for prompts, outputs in asyncio.run(run_all(node.url, 100 + round_ * SESSIONS)):
            assert outputs == [o.token_ids for o in reference.generate(prompts, greedy)]
        time.sleep(1.5)  # the TEs' last reports reach the gateway
        if hit_tokens(node.url, "stream") > 0:
            break
    reference.shutdown()
    assert by_path(node.url, "deepserve_storage_read_bytes_total")["decode"] > 0
    assert hit_tokens(node.url, "stream") > 0  # prefill TEs pulled what decode TEs read
    assert lookups(node.url, "layers_lost") == 0
