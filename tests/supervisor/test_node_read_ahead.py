"""The prefill TEs' read-ahead end to end: conf/dualpath.toml read by the
prefill TEs only (PE-only), through a slow storage bucket, with more sessions
at once than their pools hold. A request waiting for room has its disk hits
read into its TE's buffer meanwhile (prefill kv_stream_bytes,
engine/tiers/staging.py: read_ahead) and loaded from there layer by layer;
greedy tokens still equal a colocated TE's with every cache off."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from deepserve import LLM, SamplingParams
from tests.supervisor.test_node_dualpath import (OUT, ROUNDS, by_path, dualpath_config,
                                                 lookups, run_all, serving,
                                                 with_options)

pytestmark = pytest.mark.slow
SESSIONS = 8  # at once: two prefill pools of 48 blocks hold about four of them


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    config = dualpath_config(tiny_model, tmp_path_factory.mktemp("storage"))
    config = with_options(config, "prefill", storage_read_gbps=0.001)  # 25 blocks: ~0.8 s
    dualpath = msgspec.structs.replace(config.router.dualpath, read_paths="prefill")
    config = msgspec.structs.replace(config, router=msgspec.structs.replace(
        config.router, dualpath=dualpath))
    assert all(te.options["kv_stream_bytes"] > 0 for te in config.tes)  # both have buffers
    yield from serving(config)


def test_requests_waiting_for_room_have_their_hits_read_ahead(node, tiny_model):
    reference = LLM(str(tiny_model), enable_prefix_caching=False, num_kv_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=OUT)
    for round_ in range(ROUNDS):
        results = asyncio.run(run_all(node.url, 1000 + round_ * SESSIONS, SESSIONS))
        for prompts, outputs in results:
            assert outputs == [o.token_ids for o in reference.generate(prompts, greedy)]
        time.sleep(1.5)  # the TEs' last reports reach the gateway
        if lookups(node.url, "no_room_read_ahead") > 0:
            break
    reference.shutdown()
    assert lookups(node.url, "no_room_read_ahead") > 0  # the read-ahead happened ...
    assert lookups(node.url, "layers_lost") == 0  # ... and its loads all landed
    reads = by_path(node.url, "deepserve_storage_read_bytes_total")
    assert reads["prefill"] > 0 and reads["decode"] == 0  # PE-only: it is the PE's own read
