"""The remote KV tier across hosts (network namespaces, drill/netns.py):

    h0 10.213.77.1  head: cluster manager, job executor, gateway; no TE
    h1 10.213.77.2  joins: h1-te0, its KV tier (host memory)
    h2 10.213.77.3  joins later: h2-te0, its KV tier

A long prompt is served by h1-te0 alone (h2 is not up yet): its blocks go to
h1's host tier (write-through). Then h2 joins and h1's TE dies (SIGKILL; its
host's tier service lives on, and its restart is held off), so the same
prompt can only go to h2-te0, which never saw it: its cached tokens can only
come from h1's tier, over tcp. The tokens are the greedy ones.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.cluster.nodes import KEY, URL, Cluster, head_conf, node_conf
from tests.scratch import Scratch

pytestmark = pytest.mark.slow  # three nodes' process trees

PROMPT = "The remote tier serves this prompt from another host. " * 12
KV = "host_cache_bytes = 16777216"  # each joined host's KV tier


@pytest.fixture(scope="module")
def cluster(hosts, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("remote")
    scratch = Scratch()
    c = Cluster(hosts, d, scratch)
    head = hosts.addresses[0]
    c.start(0, "head", head_conf(d, tiny_model, head, node="host_cache_bytes = 0"))
    c.start(1, "h1", node_conf(d, tiny_model, "h1", hosts.addresses[1], head, ["colocated"],
                               node=KV, supervisor="restart_base_delay_s = 60.0"))
    yield from c.serving(1)



def _complete(cluster, prompt: str, max_tokens: int) -> dict:
    body = cluster.complete({"prompt": prompt, "max_tokens": max_tokens, "logprobs": 1})
    return {"ids": body["ids"], "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def test_a_prompt_hits_another_hosts_tier(cluster, hosts, tiny_model, greedy):
    first = _complete(cluster, PROMPT, 8)
    assert first["ids"] == greedy(PROMPT, 8) and first["cached"] == 0
    cluster.start(2, "h2", node_conf(cluster.d, tiny_model, "h2", hosts.addresses[2],
                                     hosts.addresses[0], ["colocated"], node=KV))
    [up] = cluster.client("wait", URL, "2", "150", timeout=200)
    assert up["num_tes"] == 2, cluster.logs()
    [te] = [e for e in cluster.events("started", "h1") if e["component"] == "h1-te0"]
    os.kill(te["pid"], signal.SIGKILL)  # h1's TE dies; h1's tier service does not
    deadline = time.monotonic() + 30
    while not [e for e in cluster.events("restarting", "h1") if e["component"] == "h1-te0"]:
        assert time.monotonic() < deadline, cluster.logs()  # the fault, seen (crashed, or
        time.sleep(0.2)  # a part's lost heartbeat first), its restart held off for 60 s
    while cluster.client("get", URL, "/health", KEY)[0].get("num_tes") != 1:
        assert time.monotonic() < deadline, cluster.logs()  # h1-te0 left the list
        time.sleep(0.2)
    second = _complete(cluster, PROMPT, 8)  # only h2-te0 is listed now
    assert second["ids"] == greedy(PROMPT, 8)
    assert second["cached"] >= 16 * 10, second  # from h1's host tier: h2 never saw it
