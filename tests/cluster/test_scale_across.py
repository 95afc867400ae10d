"""Scaling across hosts (issue 25 items 1 and 2), in three network namespaces:

    h0 10.213.77.1  head: CM, JE, gateway; [node] num_devices = 0 (no TE here);
                    [[model]] "tinys" at zero (min_tes 0, max_tes 1)
    h1 10.213.77.2  joins: no [[te]]; its [node] model is tinys's directory,
                    which its weight cache holds: placement's first choice
    h2 10.213.77.3  joins: no [[te]], and the model's directory is hidden from it
                    (an empty tmpfs over it, in a mount namespace of its own)

The first request for tinys starts its TE on a joined host (the head has no
devices): h1 when its report already says it holds the weights, else either.
Then that host is killed under load: the CM counts it lost and places the TE
on the other. h2 serves the model from a fork either way (first, or after
h1 is killed): the files pulled from a peer's weight server. Every stream
ends with the greedy tokens. Tests run in order.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.cluster.nodes import KEY, PORT, TE, URL, Cluster, head_conf, node_conf
from tests.scratch import Scratch

pytestmark = pytest.mark.slow  # three nodes, TEs started on demand

MODEL = "tinys"
PROMPTS = ["Say hi", "The cluster", "One two three", "Hello there, host"]


@pytest.fixture(scope="module")
def cluster(hosts, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("across")
    scratch = Scratch()
    c = Cluster(hosts, d, scratch)
    head = hosts.addresses[0]
    model = f'[[model]]\nname = "{MODEL}"\npath = "{tiny_model}"\nmin_tes = 0\nmax_tes = 1\n' + TE
    c.start(0, "head", head_conf(d, tiny_model, head, node="num_devices = 0",
                                 tables=model + "[scaling]\nqueue_timeout_s = 150\n"))
    c.start(1, "h1", node_conf(d, tiny_model, "h1", hosts.addresses[1], head, []))
    hide = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs tmpfs "$0" && exec "$@"', str(tiny_model.parent))
    c.start(2, "h2", node_conf(d, tiny_model, "h2", hosts.addresses[2], head, []), wrap=hide)
    yield from c.serving(0)  # the gateway answers; no TE anywhere yet


def _scaled_out(cluster, node: str) -> list[dict]:
    return [e for e in cluster.events("scaled_out", node) if e["details"]["model"] == MODEL]


def _wait_for(check, timeout_s: float, what: str, cluster):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}\n{cluster.logs()}"
        time.sleep(0.5)
    return found


def _forked(cluster) -> list[dict]:
    return [e for e in _scaled_out(cluster, "h2") if e["details"]["weights"] == "fork"]


def test_a_model_at_zero_starts_on_a_joined_host_with_the_greedy_tokens(cluster, greedy):
    *_, results = cluster.client("generate", URL, KEY, MODEL, "12", json.dumps(PROMPTS),
                                 timeout=400)
    for prompt, got in zip(PROMPTS, results):
        assert got["error"] is None, (got, cluster.logs())
        assert got["ids"] == greedy(prompt, 12), prompt
    decisions = [e for e in cluster.events("scale_decision") if e["details"]["model"] == MODEL]
    assert decisions and {e["details"]["reason"] for e in decisions} == {"demand_from_zero"}
    [placed] = [e["details"]["placed"] for e in decisions if e["details"]["placed"]]
    [(node, count)] = placed.items()
    assert node in ("h1", "h2") and count == 1  # never the head: it has no devices
    [event] = _scaled_out(cluster, node)
    assert event["component"] == f"{node}-{MODEL}-0"
    assert (event["details"]["weights"] == "fork") == (node == "h2")  # h2 has no directory
    [learned] = cluster.events("model_learned", node)
    assert learned["component"] == MODEL


def test_the_killed_host_s_te_comes_back_on_the_other_and_nothing_is_lost(
        cluster, hosts, greedy):
    [node] = [n for n in ("h1", "h2") if _scaled_out(cluster, n)]
    other = "h2" if node == "h1" else "h1"
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]
    client = hosts.python(0, "deepserve.drill.ns_client", "generate", URL, KEY, MODEL, "48",
                          json.dumps(prompts), stdout=subprocess.PIPE, text=True)
    assert json.loads(client.stdout.readline()) == {"event": "streaming"}
    assert hosts.kill_host(int(node[1])) and cluster.nodes[node].wait(10) == -9  # the fault
    [lost] = _wait_for(lambda: cluster.events("node_lost"), 30, "no node_lost", cluster)
    assert lost["details"]["node"] == node and lost["details"]["tes"] == [f"{node}-{MODEL}-0"]
    results = json.loads(client.stdout.readline())
    assert hosts.reap(client, 300) == 0
    for prompt, got in zip(prompts, results):
        assert got["error"] is None, (got, cluster.logs())
        assert got["ids"] == greedy(prompt, 48), prompt
    [event] = _scaled_out(cluster, other)
    assert event["component"] == f"{other}-{MODEL}-0"
    assert cluster.events("request_migrated"), cluster.logs()  # streams resumed there
    # h2 could not read the model's directory: it served from a fork, from a live peer
    [forked] = cluster.events("weights_forked", "h2")
    sources = {f"tcp://{hosts.addresses[0]}:{PORT + 6}", f"tcp://{hosts.addresses[1]}:{PORT + 5}"}
    assert forked["details"]["source"] in sources and forked["details"]["bytes"] > 0
    [event] = _forked(cluster)
    assert event["details"]["stages"]["fork"] > 0
