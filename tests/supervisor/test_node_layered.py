"""Layer-wise loads end to end (kv_load_layers = 1): a node whose TE reads a
disk-tier prefix one layer at a time, the first before the request queues and
the others while its prefill computes. Greedy tokens equal the cache-off
reference; a layer that fails its checksum inside the forward is a lost load
(counted), its file dropped (an event), and the request retried to the same
tokens, never a wrong one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.tiers.block_file import HEADER_BYTES, hash_name
from tests.supervisor.test_node import _metrics, _shm
from tests.supervisor.test_node_tiers import (complete, ids, push_out, reference,  # noqa: F401
                                              rewritten, tier_hits, tier_node, wait_events,
                                              wait_metric)

pytestmark = pytest.mark.slow
LAYER_BYTES = 2 * 16 * 32 * 4  # tiny: one layer's K (or V) of a block, 2 heads, float32
TE = {"num_kv_blocks": 64, "max_num_batched_tokens": 512, "kv_load_layers": 1}


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    # no scrub: the corrupt layer must be found by the forward's read, not before it
    node = tier_node(tiny_model, tmp_path_factory.mktemp("kvdisk"), TE,
                     disk_scrub_bytes_per_s=0)
    yield node
    node.stop()
    assert _shm(node) == set()


def lookups(node, outcome: str) -> float:
    return _metrics(node).get(("deepserve_tier_lookups_total", (("outcome", outcome),)), 0.0)


def test_a_disk_prefix_comes_back_layer_by_layer_with_the_same_tokens(node, reference):
    tokens, cached = complete(node, 1)
    assert cached == 0 and tokens == reference[1]
    push_out(node, (2, 3, 4, 5))  # 1's blocks: out of the device pool and the host tier
    disk_before = tier_hits(node)["disk"]
    tokens, cached = complete(node, 1)
    assert tokens == reference[1] and cached == 384
    assert wait_metric(node, "deepserve_tier_lookups_total", lambda v: v >= 1,
                       labels=(("outcome", "fetch_layers"),)) >= 1
    time.sleep(1.5)
    assert tier_hits(node)["disk"] - disk_before >= 16
    assert lookups(node, "layers_lost") == 0


def test_a_layer_corrupt_inside_the_forward_is_lost_dropped_and_retried(node, reference):
    complete(node, 9)
    push_out(node, (10, 11, 12, 13))
    block5 = prompt_block_hashes(ids(9), 16, "tenant-a")[5]
    [path] = Path(node.disk).rglob(f"{hash_name(block5)}.kv")
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 2 * LAYER_BYTES + 100] ^= 0x55  # the fault: layer 2's K, on disk
    path.write_bytes(bytes(data))
    lost_before = lookups(node, "layers_lost")
    tokens, cached = complete(node, 9)
    assert tokens == reference[9]  # the retry: blocks 0-4 from disk, 5 on computed
    assert cached == 5 * 16  # the retry's usage (an attempt lost before its first token
    # used to leave the usage empty: the gateway kept only the first attempt's prompt)
    assert wait_metric(node, "deepserve_tier_lookups_total", lambda v: v > lost_before,
                       labels=(("outcome", "layers_lost"),)) == lost_before + 1  # the fault
    found = wait_events(node, "cache_block_corrupt", lambda e: e["details"]["block"] == block5)
    assert found, "the corrupt block was not reported"
    assert rewritten(path, bytes(data))
