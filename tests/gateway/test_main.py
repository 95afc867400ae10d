"""`python -m deepserve.gateway --conf RUN/node.json --role gateway` starts,
serves, beats from its event loop, and exits 0 on SIGTERM or once its parent
is gone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import zmq

from deepserve.config.loading import load_node_config, write_run_config
from deepserve.config.addresses import RunAddresses
from deepserve.ipc.heartbeat import ENV_VAR as HEARTBEAT_ENV
from deepserve.ipc.sockets import PullSocket, free_port
from deepserve.messages.health import Heartbeat, Ready, ToSupervisor

pytestmark = pytest.mark.slow  # starts process trees


@pytest.fixture
def run_dir():
    path = Path(tempfile.mkdtemp(prefix="dsgw-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run_config(run_dir: Path, port: int) -> Path:
    """A node config with API keys, resolved the way the node resolves it."""
    (run_dir / "conf").mkdir()
    toml = run_dir / "conf" / "node.toml"
    toml.write_text(f'[node]\nmodel = "/nowhere/m"\nport = {port}\n'
                    f'[gateway]\napi_keys = {{ "k1" = "t1" }}\n[[te]]\n')
    config = load_node_config(toml).with_run(RunAddresses.in_dir(run_dir, "t", ["te0"]))
    return write_run_config(config, run_dir / "node.json")


def _wait_up(proc, port: int) -> tuple[int | None, httpx.Response | None]:
    deadline, status, models = time.monotonic() + 20, None, None
    while status is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
        except httpx.TransportError:
            time.sleep(0.05)
    return status, models


def test_main_serves_beats_and_exits_cleanly_on_sigterm(run_dir):
    port = free_port()
    conf = _run_config(run_dir, port)
    ctx = zmq.Context()
    hb_address = f"ipc://{run_dir}/hb.sock"
    inbox = PullSocket(ctx, hb_address, bind=True, type=ToSupervisor)
    argv = [sys.executable, "-m", "deepserve.gateway", "--conf", str(conf), "--role", "gateway"]
    env = {**os.environ, HEARTBEAT_ENV: hb_address}
    env.pop("DEEPSERVE_API_KEYS", None)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        status, models = _wait_up(proc, port)
        assert status == 503  # up, but no cluster manager has listed a TE
        assert models.status_code == 401  # the key from the config file is required
        got: list = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(isinstance(m, Heartbeat) for m in got) < 3:
            got += inbox.drain() or []
            time.sleep(0.1)
        assert any(isinstance(m, Ready) and m.component == "gateway" for m in got)
        beats = [m for m in got if isinstance(m, Heartbeat)]
        assert len(beats) >= 3 and {b.component for b in beats} == {"gateway"}
        ticks = [b.progress["ticks"] for b in beats]
        assert ticks == sorted(ticks) and ticks[-1] > ticks[0]  # the event loop advances it
        assert not any(b.holds_work for b in beats)  # no open request
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        inbox.close()
        ctx.term()


def test_main_exits_once_its_parent_is_gone(run_dir):
    """The parent (a shell that started the gateway) dies: uvicorn is asked to
    exit by the gateway's own loop, no side thread, no signal."""
    port = free_port()
    conf = _run_config(run_dir, port)
    pid_file = run_dir / "gateway.pid"
    starter = (f"import subprocess, sys, os, time\n"
               f"p = subprocess.Popen([sys.executable, '-m', 'deepserve.gateway', '--conf', "
               f"{str(conf)!r}, '--role', 'gateway', '--parent-pid', str(os.getpid())])\n"
               f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
               f"time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", starter])
    try:
        status, _ = _wait_up(parent, port)
        assert status == 503
        gateway_pid = int(pid_file.read_text())
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(gateway_pid):
            time.sleep(0.1)
        assert not _alive(gateway_pid), "the gateway outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by its new parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
