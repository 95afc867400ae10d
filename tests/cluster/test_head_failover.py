"""A head that outlives its host: a standby head over three hosts (network
namespaces, drill/netns.py):

    h0 10.213.77.1  head: cluster manager, job executor, gateway, and h0's TE
    h1 10.213.77.2  standby head (joins h0, [cluster] standby): its gateway, h1-te0
    h2 10.213.77.3  joins "h0,h1": h2-te0

The client runs in h1 and talks to h1's gateway only (a surviving gateway).
h0 is killed whole (SIGKILL of every process in it) while 8 streams run: h1
finds the head silent for failover_s (head_lost), starts the cluster manager
and job executor on its own host (head_taken_over), the TEs of h1 and h2
announce themselves to it, the gateway resumes what the dead JE held, and
every stream ends with the greedy tokens; requests sent afterwards are served.
Both heads keep the context registry in one shared state_dir: a context made
through h0's JE is known to h1's; both declare a [[model]] at zero, which h0's
autoscaler scales first and h1's after the take-over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.cluster.nodes import KEY, PORT, TE, URL, standby_cluster

pytestmark = pytest.mark.slow  # three nodes' process trees

PROMPTS = ["Say hi", "The cluster", "One two three", "Hello there, host"]
FAILOVER_S = 4.0  # the default: above a CM restart on a live head (test below)
SCALED = "tinys"  # a [[model]] at zero declared on both heads
CONTEXT = "You are a careful assistant. Every answer is short and exact. " * 4


@pytest.fixture(scope="module")
def cluster(hosts, tiny_model, tmp_path_factory):
    scaled = (f'[[model]]\nname = "{SCALED}"\npath = "{tiny_model}"\nmin_tes = 0\n'
              f'max_tes = 1\n{TE}[scaling]\nqueue_timeout_s = 150\n')  # on both heads
    c = standby_cluster(hosts, tiny_model, tmp_path_factory.mktemp("failover"), FAILOVER_S,
                        head_tables=f'[[te]]\ntype = "colocated"\n{TE}' + scaled,
                        standby_tables=scaled)
    yield from c.serving(3)


def _generate(hosts, prompts: list[str], max_tokens: int,
              model: str = "tiny") -> subprocess.Popen:
    """The client in h1, on h1's gateway (127.0.0.1:8000 inside h1), streaming."""
    client = hosts.python(1, "deepserve.drill.ns_client", "generate", URL, KEY, model,
                          str(max_tokens), json.dumps(prompts), stdout=subprocess.PIPE, text=True)
    assert json.loads(client.stdout.readline()) == {"event": "streaming"}
    return client


def _all_greedy(cluster, hosts, greedy, client, prompts: list[str], max_tokens: int) -> None:
    """Every stream of `client` ended without error with the greedy tokens."""
    results = json.loads(client.stdout.readline())
    assert hosts.reap(client, 300) == 0
    for prompt, got in zip(prompts, results):
        assert got["error"] is None, (got, cluster.logs())
        assert got["ids"] == greedy(prompt, max_tokens), prompt


def _call(hosts, *args: str) -> dict:
    """One client command in h1 (on h1's gateway); its one JSON line."""
    proc = hosts.python(1, "deepserve.drill.ns_client", *args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    return json.loads(out.splitlines()[-1])


def test_the_standbys_gateway_serves_through_the_head(cluster, hosts, greedy):
    _all_greedy(cluster, hosts, greedy, _generate(hosts, PROMPTS, 12), PROMPTS, 12)
    scaled = _generate(hosts, PROMPTS, 12, SCALED)  # from zero, by the head's autoscaler
    _all_greedy(cluster, hosts, greedy, scaled, PROMPTS, 12)
    assert not cluster.events("head_taken_over", "h1")  # the head is alive: no take-over
    made = _call(hosts, "post", URL, "/v1/contexts", KEY, json.dumps(
        {"model": "tiny", "prompt": CONTEXT, "ttl_s": 600}))
    assert made["status"] == 200 and made["body"]["id"].startswith("ctx-"), made
    cluster.context = made["body"]


def test_a_cluster_manager_restart_on_the_live_head_is_no_take_over(cluster):
    """The head's supervisor restarts its CM; the new CM's sign of life (an
    empty incomplete TE list each second from its start) reaches the standby
    before failover_s. Fails on a CM silent through its grace: h1 takes over
    a head that is alive, and the cluster has two."""
    [cm] = [e for e in cluster.events("started") if e["component"] == "cluster-manager"]
    os.kill(cm["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not [e for e in cluster.events("crashed") if e["component"] == "cluster-manager"]:
        assert time.monotonic() < deadline, cluster.logs()  # the fault, seen by its supervisor
        time.sleep(0.2)
    while len(cluster.events("te_list_complete")) < 2:  # the new CM listed the TEs
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    time.sleep(FAILOVER_S)
    assert not cluster.events("head_lost", "h1"), cluster.logs()


def test_the_head_host_dies_and_the_standby_takes_over_losing_nothing(cluster, hosts, greedy):
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]
    client = _generate(hosts, prompts, 48)
    killed_at = time.time()
    assert hosts.kill_host(0) and cluster.nodes["head"].wait(10) == -9  # the fault
    deadline = time.monotonic() + 30
    while not cluster.events("head_taken_over", "h1"):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    [lost] = cluster.events("head_lost", "h1")
    assert lost["details"]["head"] == f"{hosts.addresses[0]}:{PORT}"
    assert lost["details"]["silent_s"] >= FAILOVER_S
    [taken] = cluster.events("head_taken_over", "h1")
    assert taken["details"]["cm"] == f"tcp://{hosts.addresses[1]}:{PORT}"
    _all_greedy(cluster, hosts, greedy, client, prompts, 48)  # in flight: resumed, no repeat
    _all_greedy(cluster, hosts, greedy, _generate(hosts, PROMPTS, 12), PROMPTS, 12)  # afterwards
    scaled = _generate(hosts, PROMPTS, 12, SCALED)  # the [[model]]: h1's CM scales it now
    _all_greedy(cluster, hosts, greedy, scaled, PROMPTS, 12)
    # the context made through the dead head's JE: the new JE read the shared registry
    ctx = cluster.context
    got = _call(hosts, "get", URL, f"/v1/contexts/{ctx['id']}", KEY)
    assert got["id"] == ctx["id"] and got["tokens"] == ctx["tokens"], got
    used = _call(hosts, "post", URL, "/v1/completions", KEY, json.dumps(
        {"model": "tiny", "prompt": " and more", "max_tokens": 4, "temperature": 0,
         "context_id": ctx["id"]}))
    assert used["status"] == 200, used
    assert used["body"]["usage"]["prompt_tokens"] > ctx["tokens"], used
    # the new CM lists h1's and h2's TEs (h0's died with it), and the scaled one
    assert _call(hosts, "wait", URL, "3", "30") == {"num_tes": 3}, cluster.logs()
    assert time.time() - killed_at < 300
