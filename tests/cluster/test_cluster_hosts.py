"""A cluster over three hosts (network namespaces, drill/netns.py):

    h0 10.213.77.1  head: cluster manager, job executor, gateway; no TE
    h1 10.213.77.2  joins: h1-te0 colocated, h1-te1 prefill
    h2 10.213.77.3  joins: h2-te0 colocated, h2-te1 decode

Every node is `python -m deepserve.supervisor` (what bin/deepserve-node runs)
inside its host; the HTTP client runs inside h0 (drill/ns_client.py).
Since the head has no TE, every token a client gets crossed hosts. Tests run
in order: the last one kills h2 (every process in it, SIGKILL).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.cluster.nodes import KEY, PORT, URL, Cluster, head_conf, node_conf
from tests.scratch import Scratch

pytestmark = pytest.mark.slow  # three nodes' process trees

LONG = "def handler(request):\n    headers = request.headers\n    return headers\n" * 12
SHORT = ["Say hi", "The cluster", "One two three", "Hello there, host"]


@pytest.fixture(scope="module")
def cluster(hosts, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    scratch = Scratch()
    c = Cluster(hosts, d, scratch)
    head = hosts.addresses[0]
    c.start(0, "head", head_conf(d, tiny_model, head))
    c.start(1, "h1", node_conf(d, tiny_model, "h1", hosts.addresses[1], head,
                               ["colocated", "prefill"]))
    c.start(2, "h2", node_conf(d, tiny_model, "h2", hosts.addresses[2], head,
                               ["colocated", "decode"]))
    yield from c.serving(4)


def _te_ports(hosts, host: int) -> set[str]:
    """ip:port of host `host`'s TE inboxes (h1-te0, h1-te1)."""
    return {f"{hosts.addresses[host]}:{PORT + 8 + 4 * i}" for i in range(2)}


def test_tes_on_other_hosts_serve_the_head_with_greedy_tokens(cluster, hosts, greedy):
    """The head has no TE: the tokens came from h1's and h2's TEs, over tcp."""
    *_, results = cluster.client("generate", URL, KEY, "tiny", "12", json.dumps(SHORT * 2))
    for prompt, got in zip(SHORT * 2, results):
        assert got["error"] is None, (got, cluster.logs())
        assert got["ids"] == greedy(prompt, 12), prompt
    peers = {peer for _, peer in hosts.connections(0)}
    assert peers & _te_ports(hosts, 1) and peers & _te_ports(hosts, 2), peers
    for node in ("head", "h1", "h2"):  # no keys on a shared network: said by each node
        [said] = cluster.events("insecure", node)
        assert said["details"]["open"][0].startswith("cluster sockets on 10."), said


def test_a_pd_pair_split_across_hosts_gives_the_colocated_tokens(cluster, hosts, greedy):
    """A long prompt goes prefill on h1, decode on h2: KV crosses hosts over
    DistFlow tcp, and the tokens are the local greedy run's."""
    *_, [got] = cluster.client("generate", URL, KEY, "tiny", "10", json.dumps([LONG]))
    assert got["error"] is None and got["ids"] == greedy(LONG, 10), (got, cluster.logs())
    deadline = time.monotonic() + 10  # TE reports come every 0.5 s
    while 'deepserve_kv_transfer_bytes_total{te_id="h1-te1"}' not in cluster.metrics():
        assert time.monotonic() < deadline, cluster.metrics()
        time.sleep(0.5)
    between = {(a, b) for a, b in hosts.connections(2) if b.startswith(hosts.addresses[1] + ":")}
    assert between, hosts.connections(2)  # h1 and h2 talk directly, not through the head


def test_a_host_killed_mid_load_loses_no_request(cluster, hosts, greedy):
    """SIGKILL every process of h2 while 8 streams run: each stream still ends
    with exactly the greedy tokens (resumed on h1, none lost, none repeated)."""
    prompts = [f"{p} {i}" for i, p in enumerate(SHORT * 2)]
    client = hosts.python(0, "deepserve.drill.ns_client", "generate", URL, KEY, "tiny", "48",
                          json.dumps(prompts), stdout=subprocess.PIPE, text=True)
    assert json.loads(client.stdout.readline()) == {"event": "streaming"}
    killed = hosts.kill_host(2)
    assert killed and cluster.nodes["h2"].wait(10) == -9  # the fault happened
    results = json.loads(client.stdout.readline())
    assert hosts.reap(client) == 0
    for prompt, got in zip(prompts, results):
        assert got["error"] is None, (got, cluster.logs())
        assert got["ids"] == greedy(prompt, 48), prompt
    migrated = cluster.events("request_migrated")
    assert migrated, cluster.logs()  # some streams were on h2 and resumed on h1
    assert all(e["details"]["attempt"] >= 1 for e in migrated)
    # h2's colocated [[te]] TE is started on another node (its decode TE is not)
    deadline = time.monotonic() + 120
    while not (replaced := [e for e in cluster.events("scale_decision")
                            if e["details"]["reason"] == "replace_lost"]):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    [decision] = replaced
    assert decision["details"]["replaces"] == ["h2-te0"], decision
    [(node, count)] = decision["details"]["placed"].items()
    assert node != "h2" and count == 1
    log = node if node in ("h1", "h2") else "head"  # the head is named after its address
    while not [e for e in cluster.events("scaled_out", log)
               if e["details"]["reason"] == "replace_lost"]:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
