"""A cluster over three hosts (network namespaces, tests/cluster/netns.py):

    h0 10.213.77.1  head: cluster manager, job executor, gateway; no TE
    h1 10.213.77.2  joins: h1-te0 colocated, h1-te1 prefill
    h2 10.213.77.3  joins: h2-te0 colocated, h2-te1 decode

Every node is `python -m deepserve.supervisor` (what bin/deepserve-node runs)
inside its host; the HTTP client runs inside h0 (tests/cluster/client.py).
Since the head has no TE, every token a client gets crossed hosts. Tests run
in order: the last one kills h2 (every process in it, SIGKILL).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.scratch import Scratch

pytestmark = pytest.mark.slow  # three nodes' process trees

PORT = 7400
URL = "http://127.0.0.1:8000"  # the gateway, inside h0
KEY = "key-a"
LONG = "def handler(request):\n    headers = request.headers\n    return headers\n" * 12
SHORT = ["Say hi", "The cluster", "One two three", "Hello there, host"]
TE = 'max_num_batched_tokens = 128\nnum_kv_blocks = 128\nkv_transfer_backend = "tcp"\n'
START_S = 150.0


def _conf(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _head_conf(d: Path, model: Path, host: str) -> str:
    return _conf(d / "head.toml", f"""
[node]
model = "{model}"
served_model = "tiny"
te_timeout_s = 3.0
startup_timeout_s = {START_S}
[gateway]
api_keys = {{ "{KEY}" = "a" }}
[router]
pd_policy = "threshold"
pd_options = {{ min_prompt_len = 100, max_decode_len = 10000 }}
[supervisor]
log_dir = "{d / 'head-logs'}"
[cluster]
host = "{host}"
port = {PORT}
""")


def _node_conf(d: Path, model: Path, name: str, host: str, head: str, second: str) -> str:
    return _conf(d / f"{name}.toml", f"""
[node]
model = "{model}"
served_model = "tiny"
startup_timeout_s = {START_S}
[supervisor]
log_dir = "{d / (name + '-logs')}"
[cluster]
host = "{host}"
head = "{head}:{PORT}"
name = "{name}"
[[te]]
type = "colocated"
{TE}
[[te]]
type = "{second}"
{TE}
""")


class Cluster:
    def __init__(self, hosts, d: Path, scratch: Scratch):
        self.hosts, self.d, self.scratch = hosts, d, scratch
        self.nodes: dict[str, subprocess.Popen] = {}

    def start(self, host: int, name: str, conf: str) -> None:
        log = open(self.d / f"{name}.out", "wb")
        self.nodes[name] = self.hosts.python(host, "deepserve.supervisor", "--conf", conf,
                                             stdout=log, stderr=subprocess.STDOUT,
                                             env=self.scratch.env())
        log.close()

    def client(self, *args: str, timeout: float = 180.0) -> list:
        """Run the client in h0; its JSON lines."""
        proc = self.hosts.python(0, "tests.cluster.client", *args, stdout=subprocess.PIPE,
                                 text=True)
        out, _ = proc.communicate(timeout=timeout)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:]
                         for p in sorted(self.d.glob("*.out")))

    def metrics(self) -> str:
        proc = self.hosts.python(0, "tests.cluster.client", "get", URL, "/metrics", KEY,
                                 stdout=subprocess.PIPE, text=True)
        return proc.communicate(timeout=30)[0]

    def events(self, event: str) -> list[dict]:
        path = self.d / "head-logs" / "health.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e.get("event") == event]


@pytest.fixture(scope="module")
def cluster(hosts, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    scratch = Scratch()
    c = Cluster(hosts, d, scratch)
    head = hosts.addresses[0]
    c.start(0, "head", _head_conf(d, tiny_model, head))
    c.start(1, "h1", _node_conf(d, tiny_model, "h1", hosts.addresses[1], head, "prefill"))
    c.start(2, "h2", _node_conf(d, tiny_model, "h2", hosts.addresses[2], head, "decode"))
    try:
        [up] = c.client("wait", URL, "4", str(START_S), timeout=START_S + 30)
        assert up["num_tes"] == 4, c.logs()
        yield c
    finally:
        for proc in c.nodes.values():  # SIGTERM: a node stops its children and cleans up
            if proc.poll() is None:
                proc.terminate()
        for proc in c.nodes.values():
            hosts.reap(proc, 30)
        scratch.close()
        scratch.sweep()  # what the killed host could not clean (its /dev/shm would not
        scratch.remove_dir()  # outlive it)


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
    client = hosts.python(0, "tests.cluster.client", "generate", URL, KEY, "tiny", "48",
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
