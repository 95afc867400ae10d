"""A node: every process of the platform on one machine, started and stopped
together (`bin/deepserve-node --conf conf/node.toml`).

    node (this process; its supervisor thread: supervisor/supervisor.py)
    ├─ cluster manager   python -m deepserve.control.cluster_manager
    ├─ job executor      python -m deepserve.control.job_executor
    ├─ TE te0 … teN      python -m deepserve.engine.te_server  (each: tokenizer, master, workers)
    └─ gateway           python -m deepserve.gateway            (HTTP on host:port)

Children are commands, not forks: each gets --parent-pid and stops once this
process is gone, and DEEPSERVE_HEARTBEAT (the supervisor's inbox) in its
environment. All ipc:// sockets live in one short run directory; the health
log goes to log_dir/health.jsonl. Stopping is SIGTERM to every child
(gateway first), SIGKILL after a grace period.

Gang scheduling: with [node] num_devices set, a TE starts only when all its
devices (tp) are free together; a TE may evict running TEs of lower priority
to get them (each eviction is logged with its reason), else it stays down.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from deepserve.drill.hooks import ENV_VAR as DRILL_ENV
from deepserve.ipc.segments import list_segments, unlink_segment
from deepserve.supervisor.health_log import HealthLog
from deepserve.supervisor.heartbeat import ENV_VAR as HEARTBEAT_ENV
from deepserve.supervisor.node_config import NodeConfig, TESpec
from deepserve.supervisor.restart_policy import terminate
from deepserve.supervisor.supervisor import Supervisor

log = logging.getLogger(__name__)


class Node:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.run_id = uuid.uuid4().hex[:8]
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"ds-n{self.run_id}-"))
        self.address = {name: f"ipc://{self.run_dir}/{name}.sock"
                        for name in ("cm", "cm-pub", "je", "gw-reply", "hb")}
        sup = config.supervisor
        self.log_dir = Path(sup.log_dir) if sup.log_dir else self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.health = HealthLog(self.log_dir / "health.jsonl", node=f"node-{self.run_id}")
        self.drill_dir = self.run_dir / "drill" if sup.drill else None
        if self.drill_dir is not None:
            self.drill_dir.mkdir()
        self.procs: dict[str, subprocess.Popen] = {}  # name -> the live process
        self._commands: dict[str, tuple[list[str], dict]] = {}
        self._incarnation: dict[str, int] = {}  # TE id -> restarts so far
        self.te_ids = [te.te_id for te in config.tes]
        self.placed: list[TESpec] = []  # TEs holding devices, in start order
        self.supervisor: Supervisor | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> None:
        c, a = self.config, self.address
        try:
            self.supervisor = Supervisor(self)  # its inbox first: no early heartbeat is lost
            self._spawn("cluster-manager", "deepserve.control.cluster_manager", "--inbox", a["cm"],
                        "--pub", a["cm-pub"], "--te-timeout", str(c.te_timeout_s))
            je_args = ["--inbox", a["je"], "--cm-pub", a["cm-pub"], "--model", c.model,
                       "--policy", c.policy]
            if c.balance_threshold is not None:
                je_args += ["--balance-threshold", str(c.balance_threshold)]
            if c.pd_policy is not None:
                je_args += ["--pd-policy", c.pd_policy, "--pd-options", json.dumps(c.pd_options)]
                for flag, path in (("--pd-heatmap", c.pd_heatmap),
                                   ("--pd-predictor", c.pd_predictor)):
                    if path is not None:
                        je_args += [flag, path]
            self._spawn("job-executor", "deepserve.control.job_executor", *je_args)
            for te in c.tes:
                if self._place(te):
                    self._spawn(te.te_id, "deepserve.engine.te_server", "--model", c.model,
                                "--te-id", te.te_id, "--inbox",
                                f"ipc://{self.run_dir}/{te.te_id}.sock", "--cm", a["cm"],
                                "--te-type", te.te_type, "--served-model", c.served_model,
                                "--options", json.dumps(te.options),
                                "--run-id", self.te_run_id(te.te_id))
            keys = ",".join(f"{k}:{t}" for k, t in c.api_keys.items())  # env, not argv (ps)
            self._spawn("gateway", "deepserve.gateway", *self._gateway_args(),
                        env={"DEEPSERVE_API_KEYS": keys})
            self._wait_healthy()
            self.supervisor.start()
        except BaseException:
            self.stop()
            raise

    def _place(self, te: TESpec) -> bool:
        """Gang scheduling: True when all of te's devices are free (after
        evicting lower-priority TEs if that is what it takes)."""
        total = self.config.num_devices
        if total is None:
            self.placed.append(te)
            return True
        free = total - sum(t.num_devices for t in self.placed)
        victims = []
        for other in sorted((t for t in self.placed if t.priority < te.priority),
                            key=lambda t: t.priority):
            if free >= te.num_devices:
                break
            victims.append(other)
            free += other.num_devices
        if free < te.num_devices:
            self.health.write(te.te_id, "failed", None, reason=(
                f"needs {te.num_devices} devices together; {free} of {total} can be freed "
                f"(no lower-priority TE holds the rest): not started"))
            self.te_ids.remove(te.te_id)
            return False
        for other in victims:
            self.placed.remove(other)
            popen = self.procs.pop(other.te_id)
            self.te_ids.remove(other.te_id)
            self.health.write(other.te_id, "evicted", popen.pid, reason=(
                f"{te.te_id} (priority {te.priority}) needs {te.num_devices} devices together; "
                f"{other.te_id} has priority {other.priority}"), devices=other.num_devices)
            terminate(popen, self.config.supervisor.kill_grace_s, include_children=True)
        self.placed.append(te)
        return True

    def _gateway_args(self) -> list[str]:
        c, a = self.config, self.address
        return ["--host", c.host, "--port", str(c.port), "--je", a["je"], "--cm", a["cm-pub"],
                "--reply", a["gw-reply"], "--model", c.served_model,
                "--max-open-requests", str(c.max_open_requests),
                "--request-timeout", str(c.request_timeout_s), "--log-level", "warning"]

    def _spawn(self, name: str, module: str, *args: str, env: dict | None = None) -> None:
        cmd = [sys.executable, "-m", module, *args, "--parent-pid", str(os.getpid())]
        env = {**os.environ, **(env or {}), HEARTBEAT_ENV: self.address["hb"]}
        if self.drill_dir is not None:
            env[DRILL_ENV] = str(self.drill_dir)
        self._commands[name] = (cmd, env)
        self.respawn(name)

    def te_run_id(self, te_id: str) -> str:
        """The run id a TE names its shared memory with (deepserve-<run id>-*);
        each incarnation has its own, so a restart never meets a predecessor's."""
        return f"{self.run_id}{te_id}-{self._incarnation.get(te_id, 0)}"

    def sweep(self, name: str) -> list[str]:
        """Unlink the shared memory (and remove the run directories) of every
        incarnation of a killed TE."""
        if name not in self.te_ids:
            return []
        names = list_segments(f"deepserve-{self.run_id}{name}-")
        for segment in names:
            unlink_segment(segment)
        for run_dir in Path(tempfile.gettempdir()).glob(f"ds-{self.run_id}{name}-*"):
            shutil.rmtree(run_dir, ignore_errors=True)  # its launcher's ipc sockets
        return names

    def respawn(self, name: str) -> subprocess.Popen:
        """(Re)start a child with the command it was first started with."""
        cmd, env = self._commands[name]
        if name in self._incarnation:  # a TE again: a fresh run id
            self._incarnation[name] += 1
            cmd[cmd.index("--run-id") + 1] = self.te_run_id(name)
        elif "--run-id" in cmd:
            self._incarnation[name] = 0
        popen = self.procs[name] = subprocess.Popen(cmd, env=env)
        self.health.write(name, "started", popen.pid)
        return popen

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        want = len(self.te_ids)
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead:
                raise RuntimeError(f"node process died while starting: {dead}")
            if num_tes(self.url) >= want:
                return
            time.sleep(0.3)
        raise TimeoutError(f"node not healthy after {self.config.startup_timeout_s} s")

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs.items()
                if p.poll() is not None]

    def stop(self, grace_s: float = 8.0) -> None:
        """Stop supervising, then SIGTERM every child (gateway first: no new
        work), SIGKILL what is left after grace_s. Safe to call twice."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        control = ("job-executor", "cluster-manager")  # last: TEs tell the CM they leave
        for wave in ([n for n in self.procs if n not in control],
                     [n for n in self.procs if n in control]):
            for name in wave:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for name in wave:
                try:
                    self.procs[name].wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s: killing", name, grace_s)
                    terminate(self.procs[name], 0.1, include_children=True)
                    self.sweep(name)
        self.procs = {}
        for te_id in self.te_ids:  # what killed TEs (or their killed children) left
            self.sweep(te_id)
        self.health.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def num_tes(url: str) -> int:
    """TEs the gateway at url lists in /health (0 while it does not answer)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return int(json.loads(r.read()).get("num_tes", 0))
    except (urllib.error.URLError, OSError, ValueError):
        return 0
