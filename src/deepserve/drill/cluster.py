"""A cluster of three nodes on this machine, for the kill-node drill (and,
as HeadCluster, for kill-head: a head, a standby head and a node).

    head   this process's Node (conf/cluster-head.toml): cluster manager, job
           executor, gateway, [cluster] host 127.0.0.1; no TE
    n1     `python -m deepserve.supervisor --conf conf/cluster-node.toml --join ...`
           on 127.0.0.2 (its own supervisor, KV tier and TEs)
    n2     the same on 127.0.0.3: the node the drill kills

Every 127.x address is this machine's loopback, so "hosts" here share one
kernel; the nodes still talk over tcp exactly as on separate machines (the
namespace tests in tests/cluster/ run them on separate network stacks).

With [cluster] secure (the shipped confs), the drill makes a throwaway key set
in its log directory (bin/deepserve-keys' files: the cluster pair, one pair
per node, the head's and the standby's with role head) and points every node
at it (--keys), so a drill never needs, nor touches, an operator's var/keys.

Killing a node is what losing the host does: SIGKILL to the node process and
every process under it, at once (pids of the process we started and of its
descendants, never by name). What a killed node leaves (its shared memory,
run directories) goes at cleanup, as a rebooted host would lose it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from deepserve.ipc import curve_keys
from deepserve.ipc.segments import SHM_DIR
from deepserve.drill.target import model_dir
from deepserve.config.models import is_gguf
from deepserve.supervisor.node_config import with_cluster
from deepserve.supervisor.process_table import sweep_scratch
from deepserve.supervisor.ray_fabric import node_command
from deepserve.supervisor.restart_policy import terminate

ROOT = Path(__file__).resolve().parents[3]
NODE_CONF = ROOT / "conf" / "cluster-node.toml"
JOINERS = (("n1", "127.0.0.2"), ("n2", "127.0.0.3"))
STANDBY = ("s1", "127.0.0.2")  # kill-head: the standby head (HeadCluster), in n1's place
PORT_BLOCK = 16  # a node's first ports: control (head) and TE inboxes (4 each)
STOP_S = 30.0


def free_port_block(host: str, size: int = PORT_BLOCK, tries: int = 50) -> int:
    """A first port p with p .. p+size-1 all free on host right now."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        if first + size > 60000:
            continue
        if all(_is_free(host, p) for p in range(first, first + size)):
            return first
    raise RuntimeError(f"no {size} free ports in a row on {host}")


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def drill_keys(logs: Path, secure: bool, heads: list[str], nodes: list[str]) -> list[str]:
    """With `secure`: a key set of the drill's own in logs/keys (heads with role
    head) and the node command line's ["--keys", DIR]; else [] (no keys)."""
    if not secure:
        return []
    keys = logs / "keys"
    curve_keys.make_keys(keys)
    for name in heads + nodes:
        curve_keys.make_node_key(keys, name, head=name in heads)
    return ["--keys", str(keys)]


class LocalCluster:
    """The head (a Node in this process) and two joining node processes."""

    def __init__(self, head_config, node_conf: Path = NODE_CONF):
        from deepserve.supervisor.node import Node
        port = free_port_block("127.0.0.1")
        self.logs = Path(tempfile.mkdtemp(prefix="ds-drill-cluster-"))
        config = with_cluster(head_config, host="127.0.0.1", port=port)
        self.keys = drill_keys(self.logs, config.cluster.secure, [config.cluster.name],
                               [name for name, _ in JOINERS])
        self.config = with_cluster(config, keys=self.keys[1]) if self.keys else config
        self.own = Node(self.config)  # the node in this process: the drill's url and logs
        self.head_address = f"127.0.0.1:{port}"
        self.node_conf = node_conf
        self.nodes: dict[str, subprocess.Popen] = {}
        self.node_tes: dict[str, list[str]] = {}
        self.killed: dict[str, list[int]] = {}
        self._scratch: dict[str, list[str]] = {}  # node -> its run ids (what to sweep)

    @property
    def url(self) -> str:
        return self.own.url

    @property
    def log_dir(self):
        return self.own.log_dir

    @property
    def drill_dir(self):
        return self.own.drill_dir

    @property
    def num_tes(self) -> int:
        return sum(len(t) for t in self.node_tes.values()) + len(self.config.tes)

    def start(self) -> None:
        """The joining nodes first (they wait for the head), then the head,
        which is healthy once its gateway lists every joined TE."""
        from deepserve.supervisor.node_config import load_node_config
        node_config = load_node_config(self.node_conf)
        for config in (self.config, node_config):  # a joined node without it dies at once
            model = model_dir(config)
            if model and not ((Path(model) / "config.json").is_file()
                              or (is_gguf(model) and Path(model).is_file())):
                raise FileNotFoundError(f"no model at {model} (make it with "
                                        "tools/make_model.py, or point the config elsewhere)")
        for name, host in JOINERS:
            port = free_port_block(host)
            joined = with_cluster(node_config, self.head_address, host, name, port)
            self.node_tes[name] = [te.te_id for te in joined.tes]
            self._popen(name, node_command(str(self.node_conf), host, self.head_address,
                                           "--node-name", name, "--cluster-port", str(port),
                                           *self.keys))
        self.own.start()

    def _popen(self, name: str, argv: list[str]) -> None:
        """Node `name` as a child process; its output to logs/NAME.log."""
        with open(self.logs / f"{name}.log", "wb") as out:
            self.nodes[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                cwd=ROOT)

    def kill_node(self, name: str) -> tuple[list[int], float]:
        """SIGKILL node `name` and every process under it at once; (pids, time)."""
        root = psutil.Process(self.nodes[name].pid)
        procs = [root, *root.children(recursive=True)]
        self._scratch[name] = sorted({run for p in procs for run in _run_ids(p)})
        at = time.time()
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.killed[name] = [p.pid for p in procs]
        return self.killed[name], at

    def stop(self) -> None:
        for proc in self.nodes.values():
            terminate(proc, STOP_S)
        self.own.stop()
        for runs in self._scratch.values():  # what the killed node could not remove
            for run in runs:
                sweep_scratch(run)  # its TEs' segments and run directories
                shutil.rmtree(f"{SHM_DIR}/deepserve-w{run}", ignore_errors=True)  # weight cache
                shutil.rmtree(f"{SHM_DIR}/deepserve-f{run}", ignore_errors=True)  # its forks
                for path in Path(tempfile.gettempdir()).glob(f"ds-n{run}-*"):  # the node's
                    shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(self.logs, ignore_errors=True)

    def tail(self, name: str, nbytes: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_bytes()[-nbytes:].decode(errors="replace") if path.exists() else ""


class HeadCluster(LocalCluster):
    """kill-head's cluster: the head is the process killed, so it runs as a child
    here and the drill's own node (this process's Node) is a standby head:

        head   `python -m deepserve.supervisor --conf HEAD_CONF` on 127.0.0.1
               (cluster manager, job executor, gateway)
        s1     this process's Node: node_conf on 127.0.0.2, [cluster] standby,
               its gateway on 127.0.0.2 (the drill's load), its TEs
        n2     node_conf on 127.0.0.3, joined to "head,s1": it follows the live head

    url, log_dir and drill_dir are the standby's; kill_node("head") kills the head."""

    def __init__(self, head_conf: Path, node_config, node_conf: Path = NODE_CONF):
        from deepserve.supervisor.node import Node
        from deepserve.supervisor.node_config import with_port
        from deepserve.supervisor.node_config import load_node_config
        self.head_conf, self.node_conf = Path(head_conf), node_conf
        self.head_address = f"127.0.0.1:{free_port_block('127.0.0.1')}"
        self.logs = Path(tempfile.mkdtemp(prefix="ds-drill-cluster-"))
        head = with_cluster(load_node_config(self.head_conf), host="127.0.0.1").cluster
        self.keys = drill_keys(self.logs, head.secure, [head.name, STANDBY[0]], [JOINERS[1][0]])
        standby = with_cluster(node_config, self.head_address, STANDBY[1], STANDBY[0],
                               free_port_block(STANDBY[1]), standby=True,
                               keys=self.keys[1] if self.keys else None)
        self.config = with_port(standby, STANDBY[1], free_port_block(STANDBY[1], 1))
        self.own = Node(self.config)  # the standby head
        self.nodes: dict[str, subprocess.Popen] = {}
        self.node_tes: dict[str, list[str]] = {"head": []}
        self.killed: dict[str, list[int]] = {}
        self._scratch: dict[str, list[str]] = {}

    def start(self) -> None:
        """The head, then the standby (it waits until the head lists its TEs),
        then n2 (joined to both)."""
        from deepserve.supervisor.node_config import load_node_config
        host, port = self.head_address.split(":")
        self._popen("head", node_command(str(self.head_conf), host, None, "--cluster-port", port,
                                         "--port", str(free_port_block(host, 1)), *self.keys))
        self.own.start()
        name, host = JOINERS[1]
        port = free_port_block(host)
        joined = with_cluster(load_node_config(self.node_conf), self.head_address, host, name,
                              port)
        self.node_tes[name] = [te.te_id for te in joined.tes]
        standby = f"{self.config.cluster.host}:{self.config.cluster.port}"
        self._popen(name, node_command(str(self.node_conf), host,
                                       f"{self.head_address},{standby}", "--node-name", name,
                                       "--cluster-port", str(port), *self.keys))


def _run_ids(proc: psutil.Process) -> list[str]:
    """The run ids a node's process names its scratch with: its --run-id, and
    the node's own (the run directory in --conf /tmp/ds-n<run id>-.../node.json)."""
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return []
    runs = []
    for flag, value in zip(argv, argv[1:]):
        if flag == "--run-id":
            runs.append(value)
        elif flag == "--conf" and Path(value).parent.name.startswith("ds-n"):
            runs.append(Path(value).parent.name[len("ds-n"):].split("-")[0])
    return [r for r in runs if r and os.sep not in r]
