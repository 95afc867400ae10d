"""DualPath across hosts (network namespaces, drill/netns.py):

    h0 10.213.77.1  head: cluster manager, job executor (DualPath's scheduler), gateway
    h1 10.213.77.2  a decode TE; its host's KV storage (a 1 MiB host tier over a disk
                    tier), read through the decode TE's own bucket; layer streams
    h2 10.213.77.3  a prefill TE, loading layer by layer; a host tier of its own

Agentic sessions go prefill on h2 + decode on h1. A request whose read path
is the decode side has its disk hits read on h1, into the decode TE's
worker, and the prefill TE on h2 pulls them a layer at a time over tcp
(transfer/layer_stream.py) while it computes. The tokens are the greedy
ones of a cache-off run in this process; the stream is proven used by the
prefill TE's hit tokens of tier "stream" and the decode side's storage reads.
"""

from __future__ import annotations

import time

import pytest

from deepserve import LLM, SamplingParams
from tests.cluster.nodes import TE, Cluster, head_conf, node_conf
from tests.scratch import Scratch

pytestmark = pytest.mark.slow  # three nodes' process trees

SESSIONS, TURNS, CONTEXT, APPEND, OUT = 4, 3, 320, 32, 6
STORAGE = "host_cache_bytes = 1048576\ncache_cost_model = false\n"
ROUTER = ('dualpath = { alpha_tokens = 8192, beta_tokens = 65536, z_factor = 1.05, '
          'read_paths = "both" }')


@pytest.fixture(scope="module")
def cluster(hosts, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("dualpath")
    scratch = Scratch()
    c = Cluster(hosts, d, scratch)
    head = hosts.addresses[0]
    c.start(0, "head", head_conf(d, tiny_model, head, node="host_cache_bytes = 0",
                                 router=ROUTER))
    c.start(1, "h1", node_conf(
        d, tiny_model, "h1", hosts.addresses[1], head, ["decode"],
        node=STORAGE + f'disk_cache_dir = "{d / "h1-storage"}"\ndisk_cache_bytes = {256 << 20}\n',
        te=TE.replace("num_kv_blocks = 128", "num_kv_blocks = 48")
        + "kv_stream_bytes = 33554432\nstorage_read_gbps = 0.05\n"))
    c.start(2, "h2", node_conf(
        d, tiny_model, "h2", hosts.addresses[2], head, ["prefill"], node=STORAGE,
        te=TE.replace("num_kv_blocks = 128", "num_kv_blocks = 48") + "kv_load_layers = 2\n"))
    yield from c.serving(2)


def _metric(cluster, name: str, label: str, value: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for fam in text_string_to_metric_families(cluster.metrics())
               for s in fam.samples if s.name == name and s.labels.get(label) == value)


def test_a_decode_te_streams_its_storage_reads_to_a_prefill_te_on_another_host(
        cluster, tiny_model):
    reference = LLM(str(tiny_model), enable_prefix_caching=False, num_kv_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=OUT)
    trajectories = [[(s * 211 + i * 53) % 1800 + 100 for i in range(CONTEXT)]
                    for s in range(SESSIONS)]
    for turn in range(TURNS):  # the sessions in turn: the others push each one to disk
        for s, ids in enumerate(trajectories):
            if turn:
                ids += [(s * 17 + turn * 29 + i * 7) % 1800 + 100 for i in range(APPEND)]
            out = cluster.complete({"prompt": ids, "max_tokens": OUT})["ids"]
            [want] = reference.generate([list(ids)], greedy)
            assert out == want.token_ids, (s, turn)
            ids += out
    reference.shutdown()
    time.sleep(2.0)  # the TEs' last reports reach the gateway
    streamed = _metric(cluster, "deepserve_cache_hit_tokens_total", "tier", "stream")
    decode_reads = _metric(cluster, "deepserve_storage_read_bytes_total", "path", "decode")
    assert decode_reads > 0, cluster.logs()  # h1's decode TE read storage for h2
    assert streamed > 0, cluster.metrics()  # and h2's prefill TE pulled it across
    assert _metric(cluster, "deepserve_tier_lookups_total", "outcome", "layers_lost") == 0
