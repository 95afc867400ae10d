"""[cluster] secure = true over three hosts (network namespaces):

    h0 10.213.77.1  head, secure: cluster manager, job executor, gateway; no TE
    h1 10.213.77.2  joins, secure: h1-te0 prefill, h1-te1 decode (KV over DistFlow tcp)
    h2 10.213.77.3  the outsider: no key (tests/cluster/outsider.py, then a node of its own)

Members hold the cluster's server pair and a key pair each, on the allow-list
(bin/deepserve-keys DIR, DIR --node NAME); every tcp:// socket is CURVE. Each
fault is an outsider's attempt, proven by the `peer_refused` events it makes
the members write; then the test checks nothing got through and the cluster
still serves the greedy tokens. A member's key speaks only for its own node:
h1's key announcing another node's TE is ignored (`peer_ignored`).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from deepserve.ipc import curve, curve_keys
from tests.cluster.nodes import KEY, PORT, URL, Cluster, head_conf, node_conf
from tests.scratch import Scratch

pytestmark = pytest.mark.slow  # two nodes' process trees and an outsider's

LONG = "def handler(request):\n    headers = request.headers\n    return headers\n" * 12


@pytest.fixture(scope="module")
def cluster(hosts, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("secure")
    keys = d / "keys"
    curve_keys.make_keys(keys)
    curve_keys.make_node_key(keys, "head", head=True)
    curve_keys.make_node_key(keys, "h1")
    curve_keys.make_node_key(keys, "h9")  # a node that left: revoked below
    curve_keys.revoke(keys, "h9")
    scratch = Scratch()
    c = Cluster(hosts, d, scratch)
    c.keys = curve_keys.Keys.load(keys, "h1")
    c.revoked = curve_keys.Keys.load(keys, "h9")
    head = hosts.addresses[0]
    secure = f'secure = true\nkeys = "{keys}"'
    c.start(0, "head", head_conf(d, tiny_model, head, secure + '\nname = "head"'))
    c.start(1, "h1", node_conf(d, tiny_model, "h1", hosts.addresses[1], head,
                               ["prefill", "decode"], secure))
    yield from c.serving(2)


def _listening(hosts, host: int) -> list[str]:
    """host:port of every TCP listener of host `host` (TE inboxes, DistFlow receivers, ...)."""
    proc = hosts.run(host, ["ss", "-ltnH"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=10)
    return sorted({line.split()[3] for line in out.splitlines()
                   if line.split()[3].startswith(hosts.addresses[host] + ":")})


def _refused(cluster, node: str, since: float, want: int = 1, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        got = [e for e in cluster.events("peer_refused", node)
               if e["time"] > since]  # ISO-8601 UTC strings sort as times
        if len(got) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.3)


def _now_iso() -> str:
    """As the health log writes times (milliseconds): a second's resolution let a
    late refusal of the test before in."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def _greedy_pd_ok(cluster, greedy) -> None:
    *_, [got] = cluster.client("generate", URL, KEY, "tiny", "10", json.dumps([LONG]))
    assert got["error"] is None and got["ids"] == greedy(LONG, 10), (got, cluster.logs())


def test_members_serve_over_curve_with_the_greedy_tokens(cluster, hosts, greedy):
    """A long prompt: prefill on h1-te0, decode on h1-te1, the KV over DistFlow
    tcp (CURVE), the control traffic head <-> h1 too."""
    _greedy_pd_ok(cluster, greedy)
    between = {(a, b) for a, b in hosts.connections(1) if b.startswith(hosts.addresses[0])}
    assert between, hosts.connections(1)  # h1 talks to the head over tcp
    assert not cluster.events("peer_refused", "head")  # members are never refused


@pytest.mark.parametrize("outsider", ["no key", "own key", "revoked key"])
def test_an_outsider_can_neither_list_inject_nor_pull_kv(cluster, hosts, greedy, outsider):
    """no key: no CURVE at all; own key: the cluster's public key (leaked) and a
    pair of its own; revoked key: a pair once on the allow-list, taken off it."""
    since = _now_iso()
    ports = _listening(hosts, 1)
    assert len(ports) >= 6, ports  # h1's TE inboxes, PD inboxes and DistFlow receivers
    args = [f"{hosts.addresses[0]}:{PORT}", "h1-te0", json.dumps(ports)]
    if outsider != "no key":
        args.append(cluster.keys.public.decode())
    if outsider == "revoked key":
        args += [cluster.revoked.node_public.decode(), cluster.revoked.node_secret.decode()]
    proc = hosts.python(2, "tests.cluster.outsider", *args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    got = json.loads(out.splitlines()[-1])
    # the fault happened: the members refused it, each process that was tried
    head = _refused(cluster, "head", since)
    h1 = _refused(cluster, "h1", since, want=len(ports))
    assert head and h1, (got, head, h1)
    assert {e["component"] for e in head} >= {"cluster-manager"}, head
    refusing = {e["component"] for e in h1}  # the DistFlow receivers are the workers'
    assert refusing >= {"h1-te0/worker0", "h1-te1/worker0", "h1-te0/master"}, h1
    # an outsider that leaves mid-handshake (its reconnects) is a handshake broken off
    reasons = ["no CURVE", curve.BROKEN_OFF] if outsider == "no key" \
        else [curve.NOT_ALLOWED, curve.BROKEN_OFF]
    assert all(any(r in e["details"]["reason"] for r in reasons) for e in head + h1), head + h1
    if outsider != "no key":  # the key itself was refused, on both hosts
        for events in (head, h1):
            assert any(e["details"]["reason"] == curve.NOT_ALLOWED for e in events), events
    # nothing got through: no TE list, no Welcome, the injected TEDown did nothing
    assert got == {"listed": 0, "welcomed": 0, "pulled_from": len(ports)}, got
    [up] = cluster.client("wait", URL, "2", "5", timeout=30)
    assert up["num_tes"] == 2
    _greedy_pd_ok(cluster, greedy)


def test_a_members_key_speaks_only_for_its_own_node(cluster, hosts, greedy):
    """h1's own key pair (a member gone rogue) from h2: it gets in, but its TEUp
    and its TEDown for another node's TE ids are ignored by the cluster manager,
    which says so (peer_ignored); the TE list stays as it was."""
    since = _now_iso()
    args = [f"{hosts.addresses[0]}:{PORT}", "n7-te1", "[]", cluster.keys.public.decode(),
            cluster.keys.node_public.decode(), cluster.keys.node_secret.decode(), "n7-te0"]
    proc = hosts.python(2, "tests.cluster.outsider", *args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    got = json.loads(out.splitlines()[-1])
    assert got["listed"] > 0  # a member: it reads the TE lists
    deadline = time.monotonic() + 10
    while True:
        ignored = [e for e in cluster.events("peer_ignored", "head") if e["time"] > since]
        if len(ignored) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert ignored and all(e["component"] == "cluster-manager" for e in ignored), ignored
    assert all(e["details"]["peer"] == "h1" for e in ignored), ignored
    assert {e["details"]["message"] for e in ignored} <= {"TEUp", "TEDown"}, ignored
    assert not cluster.events("peer_refused", "head") or all(
        e["time"] <= since for e in cluster.events("peer_refused", "head"))
    [up] = cluster.client("wait", URL, "2", "5", timeout=30)
    assert up["num_tes"] == 2  # no n7-te0 listed
    _greedy_pd_ok(cluster, greedy)


def test_a_node_without_the_key_cannot_join_and_says_why(cluster, hosts, tiny_model, greedy):
    """A whole node in h2 with no key joins the head: the head logs the
    refusals, the node gives up at once with the reason (not after its startup
    timeout), and the cluster still lists and serves its own two TEs."""
    since = _now_iso()
    cluster.start(2, "h2", node_conf(cluster.d, tiny_model, "h2", hosts.addresses[2],
                                     hosts.addresses[0], ["colocated"]))
    assert hosts.reap(cluster.nodes["h2"], 60) == 1, cluster.logs()
    refused = _refused(cluster, "head", since)
    assert refused, cluster.logs()  # the fault: h2 dialled the head, which refused it
    assert all(e["details"]["reason"] in ("no CURVE (the peer has no cluster key)",
                                          curve.BROKEN_OFF) for e in refused), refused
    out = (cluster.d / "h2.out").read_text()
    assert "refuses this node" in out and "[cluster] secure" in out, out
    assert "joined the cluster" not in out
    [up] = cluster.client("wait", URL, "3", "3", timeout=30)
    assert up["num_tes"] == 2, (up, cluster.logs())
    _greedy_pd_ok(cluster, greedy)
