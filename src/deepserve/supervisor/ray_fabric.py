"""Ray as the cluster fabric (`bin/deepserve-up --cluster ADDRESS|local`).

    this process (the fabric; on a Ray node: the head host)
      ├─ the head node     python -m deepserve.supervisor --conf HEAD.toml
      │                    --cluster-host <this Ray node's IP>    (own session)
      └─ a NodeAgent actor on every alive Ray node, now and as hosts join
           (pinned: NodeAffinitySchedulingStrategy, soft=False)
           └─ python -m deepserve.supervisor --conf NODE.toml --join HEAD
              --cluster-host <its Ray node's IP>                 (own session)

Ray gives membership (ray.nodes()), placement (one agent per host, a host
that joins with `ray start --address` gets one within POLL_S) and process
launch across hosts. It never carries a token or a tensor: the nodes talk
ZeroMQ tcp and DistFlow tcp between hosts, ipc:// and shared memory within.

The Ray head is not on the serving path: every deepserve node runs in its own
session, so neither a Ray worker nor the fabric dying (Ray's raylets kill
their workers some time after the Ray head is lost) stops it. Placements made
keep serving; new hosts wait, loudly (the fabric logs every failed look at
the Ray cluster), until Ray answers again. A host that dies takes its node
with it; the head's cluster manager drops its TEs after te_timeout_s and
their requests resume elsewhere.

Keys (a head conf with [cluster] secure): the fabric holds the cluster's key
directory (the head's [cluster] keys: the cluster pair and the head's own, made
with bin/deepserve-keys; on Kubernetes a Secret, conf/k8s/). For each host that
joins it makes the node's pair there (named after the host: n10-0-0-2), hands
the agent what that host needs (the cluster pair, the node's pair, the
allow-list; ipc/curve_keys.py node_bundle) and the agent writes them to a
private directory (0700) for its node (--keys, --node-name). Whenever a host
joins, every agent's copy of the allow-list is brought up to date, so the
nodes admit each other. Ray's own channel carries those keys: run Ray with its
token authentication (RAY_AUTH_MODE=token) on a network only the cluster reaches.

Not done here: restarting the head node on another host (its address is
what the joined nodes dial), reconciling with nodes left by an earlier fabric.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from deepserve.config.cluster import ClusterSection
from deepserve.ipc import curve_keys
from deepserve.supervisor.restart_policy import terminate

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[3]
POLL_S = 2.0
RAY_TIMEOUT_S = 10.0
STOP_S = 30.0


def _ray():
    try:
        import ray
    except ImportError:
        raise SystemExit("--cluster needs Ray: pip install 'deepserve[cluster]' "
                         "(single-host bin/deepserve-up needs no Ray)") from None
    return ray


def node_command(conf: str, host: str, join: str | None, *extra: str) -> list[str]:
    """argv of a node (`python -m deepserve.supervisor`) on host `host`, joined
    to `join` (HOST:PORT) or, with None, the head."""
    cmd = [sys.executable, "-m", "deepserve.supervisor", "--conf", conf, "--cluster-host", host]
    return cmd + (["--join", join] if join else []) + list(extra)


class NodeAgent:
    """One per host (a Ray actor pinned to its node): starts that host's
    deepserve node, joined to the head, and stops it when told."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.keys: Path | None = None  # this host's copy of its keys (a secure cluster)

    def start(self, conf: str, join: str, log_path: str, name: str | None = None,
              keys: dict[str, bytes] | None = None) -> dict:
        """Start this host's node; with `keys` (a node_bundle for node `name`),
        under those keys, written to a private directory first."""
        import ray
        host = ray.util.get_node_ip_address()
        extra: list[str] = []
        if keys is not None:
            self.keys = Path(tempfile.mkdtemp(prefix="ds-keys-"))
            curve_keys.write_bundle(self.keys, keys)
            extra = ["--keys", str(self.keys), "--node-name", name]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)  # on this agent's host
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(node_command(conf, host, join, *extra), stdout=out,
                                         stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)
        return {"host": host, "pid": self.proc.pid, "name": name}

    def allow(self, allowed: dict[str, bytes]) -> int:
        """The fabric's allow-list now: this host's copy follows (read again by
        its node on the next connection). How many keys it holds."""
        if self.keys is not None:
            curve_keys.write_bundle(self.keys, allowed)
        return len(allowed)

    def status(self) -> int | None:
        """None while the node runs; its exit code once it stopped."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> int | None:
        if self.keys is not None:
            shutil.rmtree(self.keys, ignore_errors=True)
        if self.proc is None:
            return None
        terminate(self.proc, STOP_S)
        return self.proc.returncode


class Fabric:
    """The head node and an agent per Ray node; `watch` places agents as hosts join."""

    def __init__(self, ray, head_conf: str, node_conf: str, port: int, log_dir: Path,
                 head_args: list[str] = (), keys: Path | None = None):
        """keys: the cluster's key directory (a secure head conf), or None."""
        self.ray, self.head_conf, self.node_conf, self.log_dir = ray, head_conf, node_conf, log_dir
        self.keys = keys
        self.head_args = list(head_args)
        self.host = ray.util.get_node_ip_address()
        self.join = f"{self.host}:{port}"
        self.head: subprocess.Popen | None = None
        self.agents: dict[str, object] = {}  # Ray node id -> its NodeAgent handle
        self.placed: dict[str, dict] = {}  # Ray node id -> {"host", "pid"}
        self.ray_down_since: float | None = None
        self._stop = threading.Event()
        self._agent_class = ray.remote(num_cpus=0, max_restarts=0)(NodeAgent)

    def start(self) -> None:
        head_log = open(self.log_dir / "head.log", "ab")
        self.head = subprocess.Popen(
            node_command(self.head_conf, self.host, None, *self.head_args,
                         "--cluster-port", self.join.rsplit(":", 1)[1]),
            stdout=head_log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        head_log.close()
        self.place()

    def place(self) -> None:
        """An agent (and so a joined node) on every alive Ray node without one."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        joined = False
        for node in alive:
            node_id = node["NodeID"]
            if node_id in self.agents:
                continue
            agent = self._agent_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
            log_path = str(self.log_dir / f"node-{node['NodeManagerAddress']}.log")
            name = ClusterSection(host=node["NodeManagerAddress"]).name
            keys = curve_keys.node_bundle(self.keys, name) if self.keys else None
            try:
                self.placed[node_id] = self.ray.get(
                    agent.start.remote(self.node_conf, self.join, log_path, name, keys),
                    timeout=60)
            except Exception:
                try:
                    self.ray.kill(agent)  # the next look places a new one
                except Exception:  # noqa: BLE001 - Ray itself may be what failed
                    pass
                raise
            self.agents[node_id] = agent
            joined = True
            log.warning("fabric: host %s joined: node pid %d", self.placed[node_id]["host"],
                        self.placed[node_id]["pid"])
        if joined and self.keys:  # every host admits the newcomers
            allowed = curve_keys.allowed_bundle(self.keys)
            self.ray.get([a.allow.remote(allowed) for a in self.agents.values()], timeout=60)
            log.warning("fabric: allow-list of %d keys on every host", len(allowed))
        gone = set(self.agents) - {n["NodeID"] for n in alive}
        for node_id in gone:
            log.error("fabric: Ray lost host %s; the head drops its TEs after te_timeout_s",
                      self.placed.get(node_id, {}).get("host"))
            del self.agents[node_id]

    def watch(self) -> None:
        """Place agents every POLL_S. A look at Ray runs in a daemon thread of
        its own: with its head gone, Ray's calls wait to reconnect rather than
        fail, so a look that takes over RAY_TIMEOUT_S counts as Ray not
        answering (logged, never fatal); the next starts once it returned."""
        look: tuple[threading.Event, dict] | None = None
        while not self._stop.wait(POLL_S):
            if look is None:
                look = self._look()
            done, box = look
            if done.wait(RAY_TIMEOUT_S):
                look = None
                if "error" not in box:
                    if self.ray_down_since is not None:
                        log.warning("fabric: Ray answers again after %.1f s",
                                    time.monotonic() - self.ray_down_since)
                        self.ray_down_since = None
                    continue
            why = box.get("error") or f"no answer within {RAY_TIMEOUT_S} s"
            if self.ray_down_since is None:
                self.ray_down_since = time.monotonic()
                log.error("fabric: Ray does not answer (%s); the nodes keep serving, new "
                          "hosts wait", why)

    def _look(self) -> tuple[threading.Event, dict]:
        done, box = threading.Event(), {}

        def run() -> None:
            try:
                self.place()
            except Exception as e:  # noqa: BLE001 - Ray's errors vary; serving goes on
                box["error"] = f"{type(e).__name__}: {e}"
            finally:
                done.set()
        threading.Thread(target=run, name="ray-look", daemon=True).start()
        return done, box

    def head_exit(self) -> int | None:
        return None if self.head is None else self.head.poll()

    def stop(self) -> None:
        """Every agent stops its node; where Ray cannot reach an agent, the node
        on this host is stopped by its pid, one on another host is left (said)."""
        self._stop.set()
        for node_id, agent in list(self.agents.items()):
            if self.ray_down_since is None:
                try:
                    self.ray.get(agent.stop.remote(), timeout=STOP_S + 5)
                    continue
                except Exception as e:  # noqa: BLE001 - Ray gone: see below
                    log.error("fabric: an agent did not stop its node (%s)", e)
            info = self.placed.get(node_id, {})
            if info.get("host") == self.host:  # our host: its pid is this machine's
                terminate(info["pid"], STOP_S)
            else:
                log.error("fabric: the node on %s (pid %s there) is left running: Ray cannot "
                          "reach its agent", info.get("host"), info.get("pid"))
        if self.head is not None:
            terminate(self.head, STOP_S)


@click.command()
@click.option("--cluster", "address", required=True, metavar="ADDRESS|local",
              help="a Ray cluster's address (HOST:PORT), or local: start one here")
@click.option("--conf", "head_conf", default=str(ROOT / "conf" / "cluster-head.toml"),
              type=click.Path(exists=True, dir_okay=False), help="the head node's config")
@click.option("--node-conf", default=str(ROOT / "conf" / "cluster-node.toml"),
              type=click.Path(exists=True, dir_okay=False), help="every joined node's config")
@click.option("--cluster-port", default=7400, type=click.IntRange(1024, 60000),
              help="the head's first TCP port")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False),
              help="the nodes' console logs, each host's under this path on that host "
                   "(default: a new temporary folder)")
@click.option("--host", "http_host", default=None,
              help="overrides the head's [node] host (the gateway's HTTP interface)")
@click.option("--port", "http_port", default=None, type=click.IntRange(1, 65535),
              help="overrides the head's [node] port (the gateway's HTTP port)")
def main(address: str, head_conf: str, node_conf: str, cluster_port: int,
         log_dir: str | None, http_host: str | None, http_port: int | None) -> None:
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s fabric[%(process)d] %(levelname)s %(message)s")
    from deepserve.actor import ActorLife
    ray = _ray()
    ray.init(address=None if address == "local" else address, include_dashboard=False,
             log_to_driver=False, logging_level=logging.WARNING)
    logs = Path(log_dir or tempfile.mkdtemp(prefix="ds-fabric-"))
    logs.mkdir(parents=True, exist_ok=True)
    head_args = (["--host", http_host] if http_host else []) + (
        ["--port", str(http_port)] if http_port else [])
    from deepserve.supervisor.node_config import load_node_config
    head = load_node_config(head_conf).cluster
    fabric = Fabric(ray, head_conf, node_conf, cluster_port, logs, head_args,
                    ROOT / head.keys if head.secure else None)
    life = ActorLife("fabric")  # SIGTERM / SIGINT only set its flag
    watcher = threading.Thread(target=fabric.watch, name="fabric-watch", daemon=True)
    try:
        fabric.start()
        watcher.start()
        click.echo(f"DeepServe cluster over Ray {address}: head at {fabric.join} "
                   f"(logs {logs}); hosts joined: "
                   f"{', '.join(p['host'] for p in fabric.placed.values())}", err=False)
        sys.stdout.flush()
        def head_runs() -> bool:
            time.sleep(0.3)
            return fabric.head_exit() is None
        life.run(head_runs, lambda: {})
    finally:
        fabric.stop()
        life.close()
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - Ray may be gone already
            pass


if __name__ == "__main__":
    main()
