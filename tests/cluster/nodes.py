"""A cluster of nodes, one per host namespace (drill/netns.py), for the
cluster tests: each node is `python -m deepserve.supervisor` (what
bin/deepserve-node runs) inside its host; the HTTP client (drill/ns_client.py)
runs inside h0, where the gateway is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from tests.scratch import Scratch

URL = "http://127.0.0.1:8000"  # the gateway, inside h0
KEY = "key-a"
PORT = 7400
START_S = 150.0
TE = 'max_num_batched_tokens = 128\nnum_kv_blocks = 128\nkv_transfer_backend = "tcp"\n'
"""Every cluster test's TE: small, and KV over DistFlow tcp (namespaces share /dev/shm)."""


def conf(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _guarded(cluster: str) -> str:
    """[cluster] lines: the namespaces' addresses are not loopback, so a node
    without secure = true says insecure = true (else it refuses to start)."""
    return cluster if "secure = true" in cluster else cluster + "\ninsecure = true"


def head_conf(d: Path, model: Path, host: str, cluster: str = "", node: str = "",
              tables: str = "", router: str = "") -> str:
    """The head: cluster manager, job executor, gateway, no TE; long prompts go
    prefill + decode. `cluster` / `node` / `router`: more lines of those tables;
    `tables`: more tables ([[model]], [scaling])."""
    return conf(d / "head.toml", f"""
[node]
model = "{model}"
served_model = "tiny"
te_timeout_s = 3.0
startup_timeout_s = {START_S}
{node}
[gateway]
api_keys = {{ "{KEY}" = "a" }}
[router]
pd_policy = "threshold"
pd_options = {{ min_prompt_len = 100, max_decode_len = 10000 }}
{router}
[supervisor]
log_dir = "{d / 'head-logs'}"
[cluster]
host = "{host}"
port = {PORT}
{_guarded(cluster)}
{tables}
""")


def node_conf(d: Path, model: Path, name: str, host: str, head: str, tes: list[str],
              cluster: str = "", tables: str = "", supervisor: str = "",
              node: str = "", te: str = TE) -> str:
    """A node joining `head` with one TE of each type in `tes`, each with the
    lines `te`; `tables`: more tables ([[model]] on a standby head);
    `supervisor` / `node`: more lines of them."""
    return conf(d / f"{name}.toml", f"""
[node]
model = "{model}"
served_model = "tiny"
startup_timeout_s = {START_S}
{node}
[supervisor]
log_dir = "{d / (name + '-logs')}"
{supervisor}
[cluster]
host = "{host}"
head = "{head}:{PORT}"
name = "{name}"
{_guarded(cluster)}
""" + "".join(f'[[te]]\ntype = "{t}"\n{te}' for t in tes) + tables)


class Cluster:
    def __init__(self, hosts, d: Path, scratch: Scratch):
        self.hosts, self.d, self.scratch = hosts, d, scratch
        self.nodes: dict[str, subprocess.Popen] = {}

    def start(self, host: int, name: str, conf: str, wrap: tuple[str, ...] = ()) -> None:
        """Node `name` in host `host`; wrap: a command it runs under (it execs the rest)."""
        log = open(self.d / f"{name}.out", "wb")
        self.nodes[name] = self.hosts.run(
            host, [*wrap, sys.executable, "-m", "deepserve.supervisor", "--conf", conf],
            stdout=log, stderr=subprocess.STDOUT, env=self.scratch.env())
        log.close()

    def serving(self, num_tes: int) -> Iterator["Cluster"]:
        """A module fixture's end, its nodes started: the gateway lists num_tes
        TEs (asserted), then this cluster; stopped whatever happens
        (`yield from cluster.serving(n)`)."""
        try:
            [up] = self.client("wait", URL, str(num_tes), str(START_S), timeout=START_S + 30)
            assert up["num_tes"] == num_tes, self.logs()
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM every node (a node stops its children and cleans up), reap them,
        then sweep what a killed host could not clean (its /dev/shm would not outlive it)."""
        self.hosts.stop(list(self.nodes.values()), 30)
        self.scratch.close()
        self.scratch.sweep()
        self.scratch.remove_dir()

    def client(self, *args: str, timeout: float = 180.0) -> list:
        """Run the client in h0; its JSON lines."""
        proc = self.hosts.python(0, "deepserve.drill.ns_client", *args, stdout=subprocess.PIPE,
                                 text=True)
        out, _ = proc.communicate(timeout=timeout)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def complete(self, body: dict, timeout: float = 120.0) -> dict:
        """POST /v1/completions from h0 (model "tiny", greedy, token ids in logprobs);
        its 200 body, with "ids" added: the completion's token ids."""
        body = {"model": "tiny", "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True, **body}
        proc = self.hosts.python(0, "deepserve.drill.ns_client", "post", URL, "/v1/completions",
                                 KEY, json.dumps(body), stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=timeout)
        answer = json.loads(out.splitlines()[-1])
        assert answer["status"] == 200, (answer, self.logs())
        tokens = answer["body"]["choices"][0]["logprobs"]["tokens"]
        return {**answer["body"], "ids": [int(t.split(":")[1]) for t in tokens]}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:]
                         for p in sorted(self.d.glob("*.out")))

    def metrics(self) -> str:
        proc = self.hosts.python(0, "deepserve.drill.ns_client", "get", URL, "/metrics", KEY,
                                 stdout=subprocess.PIPE, text=True)
        return proc.communicate(timeout=30)[0]

    def events(self, event: str, node: str = "head") -> list[dict]:
        """`event`s in `node`'s health log (its conf's log_dir: d/NODE-logs)."""
        path = self.d / f"{node}-logs" / "health.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e.get("event") == event]


def standby_cluster(hosts, model: Path, d: Path, failover_s: float, head_tables: str = "",
                    standby_tables: str = "") -> Cluster:
    """h0 the head, h1 its standby (h1-te0), h2 joined to both (h2-te0), the
    heads sharing d/state (`state`: contexts, head terms); `*_tables`: more
    tables of the head's and the standby's confs. Started, not yet serving."""
    c = Cluster(hosts, d, Scratch())
    head, standby = hosts.addresses[0], hosts.addresses[1]
    c.state = d / "state"
    c.state.mkdir()
    state = f'state_dir = "{c.state}"'
    c.start(0, "head", head_conf(d, model, head, cluster=state, tables=head_tables))
    c.start(1, "h1", node_conf(d, model, "h1", standby, head, ["colocated"],
                               cluster=f"standby = true\nfailover_s = {failover_s}\n{state}",
                               tables=standby_tables))
    c.start(2, "h2", node_conf(d, model, "h2", hosts.addresses[2], f"{head}:{PORT},{standby}",
                               ["colocated"]))
    return c
