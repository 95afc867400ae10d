"""Ray as the fabric, on three hosts (network namespaces, drill/netns.py):

    h0  `ray start --head` + the fabric (supervisor/ray_fabric.py): the head node
    h1  `ray start --address h0`
    h2  `ray start --address h0`

The fabric puts a NodeAgent on every Ray node (h0 included), each starts its
host's node joined to the head: three TEs on three hosts, under keys: the
fabric holds the key directory (the cluster's pair and the head's) and hands
each host its node's pair and the allow-list. Then the Ray head's
GCS is SIGKILLed: the fabric notices (its log says Ray does not answer) and
requests keep flowing, since Ray is not on the serving path.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from deepserve.ipc import curve_keys
from tests.cluster.test_cluster_hosts import KEY, SHORT, URL
from tests.scratch import Scratch

pytest.importorskip("ray", reason="the Ray fabric needs the cluster extra (ray)")
pytestmark = pytest.mark.slow  # three Ray nodes and three deepserve nodes

RAY_PORT = 6390
START_S = 240.0
RAY = str(Path(sys.executable).parent / "ray")


def _ray_start(hosts, host: int, temp_dir: str, env: dict, out: Path) -> subprocess.Popen:
    """`ray start` on a host, with a temp dir of its own: Ray nodes that share a
    filesystem (as our hosts do) and a session directory trip over each other."""
    args = [RAY, "start", "--block", "--node-ip-address", hosts.addresses[host], "--num-cpus",
            "1", "--object-store-memory", str(80 << 20), "--disable-usage-stats",
            "--temp-dir", temp_dir]
    if host == 0:
        args += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
    else:
        args += ["--address", f"{hosts.addresses[0]}:{RAY_PORT}"]
    with open(out, "wb") as log:
        return hosts.run(host, args, stdout=log, stderr=subprocess.STDOUT, env=env)


def _client(hosts, *args: str, timeout: float = 240.0) -> list:
    proc = hosts.python(0, "deepserve.drill.ns_client", *args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _conf(d: Path, name: str, text: str) -> str:
    (d / name).write_text(text)
    return str(d / name)


@pytest.fixture(scope="module")
def fabric(hosts, tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("fabric")
    scratch = Scratch()  # the nodes' TMPDIR (through Ray's daemons to the fabric's actors)
    temp_dirs = [tempfile.mkdtemp(prefix="dsray-", dir="/tmp") for _ in range(3)]  # short paths
    keys = d / "keys"  # what an operator makes: the cluster's pair and the head's
    curve_keys.make_keys(keys)
    curve_keys.make_node_key(keys, "head", head=True)
    head = _conf(d, "head.toml", f"""
[node]
model = "{tiny_model}"
served_model = "tiny"
te_timeout_s = 3.0
[gateway]
api_keys = {{ "{KEY}" = "a" }}
[supervisor]
log_dir = "{d / 'head-logs'}"
[cluster]
host = "127.0.0.1"
name = "head"
secure = true
keys = "{keys}"
""")
    node = _conf(d, "node.toml", f"""
[node]
model = "{tiny_model}"
served_model = "tiny"
[[te]]
max_num_batched_tokens = 128
num_kv_blocks = 128
[cluster]
host = "127.0.0.1"
head = "127.0.0.1:7400"
secure = true
""")
    # Ray's token authentication, one token for this cluster (every Ray process, the fabric)
    env = {**scratch.env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    rays = [_ray_start(hosts, 0, temp_dirs[0], env, d / "ray-h0.log")]
    deadline = time.monotonic() + 60  # the GCS first
    while "Ray runtime started" not in (d / "ray-h0.log").read_text(errors="replace"):
        assert time.monotonic() < deadline and rays[0].poll() is None, _logs(d)
        time.sleep(0.3)
    rays += [_ray_start(hosts, i, temp_dirs[i], env, d / f"ray-h{i}.log") for i in (1, 2)]
    fabric_log = open(d / "fabric.log", "wb")
    proc = hosts.python(0, "deepserve.supervisor.ray_fabric", "--cluster",
                        f"{hosts.addresses[0]}:{RAY_PORT}", "--conf", head, "--node-conf", node,
                        "--log-dir", str(d / "nodes"), stdout=fabric_log,
                        stderr=subprocess.STDOUT, env=env)
    fabric_log.close()
    state = {"dir": d, "proc": proc, "rays": rays, "log": d / "fabric.log", "keys": keys,
             "scratch": scratch}
    try:
        [up] = _client(hosts, "wait", URL, "3", str(START_S), timeout=START_S + 30)
        assert up["num_tes"] == 3, _logs(d)
        yield state
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the fabric stops its nodes, by their pids too
        hosts.reap(proc, 60)
        for host in range(3):  # the Ray daemons (and anything they left) go with their host
            hosts.kill_host(host)
        for ray in rays:
            hosts.reap(ray)
        for temp_dir in temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)
        scratch.close()
        scratch.sweep()  # what the killed Ray head's node could not clean
        scratch.remove_dir()


def _logs(d: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted(d.rglob("*.log")))


def test_the_fabric_puts_a_node_on_every_ray_host_and_serves(fabric, hosts):
    text = fabric["log"].read_text()
    for address in hosts.addresses:  # one node per Ray host, each joined under its own address
        assert f"host {address} joined" in text, _logs(fabric["dir"])
    *_, results = _client(hosts, "generate", URL, KEY, "tiny", "8", json.dumps(SHORT))
    assert all(r["error"] is None and len(r["ids"]) == 8 for r in results), results
    peers = {peer for _, peer in hosts.connections(0)}  # the JE to each host's TE inbox
    assert {f"{hosts.addresses[i]}:7408" for i in (1, 2)} <= peers, peers
    names = {"head"} | {"n" + a.replace(".", "-") for a in hosts.addresses}
    assert {p.stem for p in (fabric["keys"] / "allowed").glob("*.key")} == names
    copies = sorted(fabric["scratch"].tmp.glob("ds-keys-*"))  # each host's, from its agent
    assert len(copies) == 3, copies
    for copy in copies:
        assert copy.stat().st_mode & 0o777 == 0o700
        assert {p.stem for p in (copy / "allowed").glob("*.key")} == names  # every newcomer
        [secret] = [p for p in copy.glob("n*.key_secret")]  # its own pair only
        assert secret.stat().st_mode & 0o777 == 0o600
        assert (copy / "cluster.key_secret").is_file() and not (copy / "head.key_secret").exists()


def test_requests_keep_flowing_when_the_ray_head_dies(fabric, hosts, greedy):
    ray_head = psutil.Process(fabric["rays"][0].pid)
    [gcs] = [p for p in ray_head.children(recursive=True) if p.name() == "gcs_server"]
    gcs.kill()
    assert gcs.wait(10) is not None or not gcs.is_running()  # the fault happened
    deadline = time.monotonic() + 30  # the fabric's next look at Ray fails, loudly
    while "Ray does not answer" not in fabric["log"].read_text():
        assert time.monotonic() < deadline, _logs(fabric["dir"])
        time.sleep(0.5)
    for _ in range(2):  # right after, and again a few seconds on
        *_, results = _client(hosts, "generate", URL, KEY, "tiny", "12", json.dumps(SHORT))
        for prompt, got in zip(SHORT, results):
            assert got["error"] is None and got["ids"] == greedy(prompt, 12), (got, prompt)
        time.sleep(3)
