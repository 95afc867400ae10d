"""A node: every process of the platform on one machine, started and stopped
together (`bin/deepserve-node --conf conf/node.toml`).

    node (this process)
    ├─ cluster manager   python -m deepserve.control.cluster_manager
    ├─ job executor      python -m deepserve.control.job_executor
    ├─ TE te0 … teN      python -m deepserve.engine.te_server  (each: tokenizer, master, workers)
    └─ gateway           python -m deepserve.gateway            (HTTP on host:port)

Children are commands, not forks: each gets --parent-pid and stops once this
process is gone. All ipc:// sockets live in one short run directory. Stopping
is SIGTERM to every child (gateway first), SIGKILL after a grace period.
Restarts and hang detection belong to the supervisor issue; here a child that
dies is reported, and a TE that dies leaves the TE list.
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
from dataclasses import dataclass
from pathlib import Path

from deepserve.supervisor.node_config import NodeConfig

log = logging.getLogger(__name__)


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen


class Node:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.run_id = uuid.uuid4().hex[:8]
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"ds-n{self.run_id}-"))
        self.address = {name: f"ipc://{self.run_dir}/{name}.sock"
                        for name in ("cm", "cm-pub", "je", "gw-reply")}
        self.procs: list[_Proc] = []

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> None:
        c, a = self.config, self.address
        try:
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
                self._spawn(te.te_id, "deepserve.engine.te_server", "--model", c.model,
                            "--te-id", te.te_id, "--inbox", f"ipc://{self.run_dir}/{te.te_id}.sock",
                            "--cm", a["cm"], "--te-type", te.te_type,
                            "--served-model", c.served_model, "--options", json.dumps(te.options))
            keys = ",".join(f"{k}:{t}" for k, t in c.api_keys.items())  # env, not argv (ps)
            self._spawn("gateway", "deepserve.gateway", *self._gateway_args(),
                        env={**os.environ, "DEEPSERVE_API_KEYS": keys})
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _gateway_args(self) -> list[str]:
        c, a = self.config, self.address
        return ["--host", c.host, "--port", str(c.port), "--je", a["je"], "--cm", a["cm-pub"],
                "--reply", a["gw-reply"], "--model", c.served_model,
                "--max-open-requests", str(c.max_open_requests),
                "--request-timeout", str(c.request_timeout_s), "--log-level", "warning"]

    def _spawn(self, name: str, module: str, *args: str, env: dict | None = None) -> None:
        cmd = [sys.executable, "-m", module, *args, "--parent-pid", str(os.getpid())]
        self.procs.append(_Proc(name, subprocess.Popen(cmd, env=env)))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        want = len(self.config.tes)
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead:
                raise RuntimeError(f"node process died while starting: {dead}")
            if _num_tes(self.url) >= want:
                return
            time.sleep(0.3)
        raise TimeoutError(f"node not healthy after {self.config.startup_timeout_s} s")

    def dead(self) -> list[str]:
        return [f"{p.name} (exit {p.popen.returncode})" for p in self.procs
                if p.popen.poll() is not None]

    def stop(self, grace_s: float = 8.0) -> None:
        """SIGTERM every child (gateway first: no new work), then SIGKILL."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing", p.name, grace_s)
                p.popen.kill()
                p.popen.wait(5)
        self.procs = []
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _num_tes(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return int(json.loads(r.read()).get("num_tes", 0))
    except (urllib.error.URLError, OSError, ValueError):
        return 0
