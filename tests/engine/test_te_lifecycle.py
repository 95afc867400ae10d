"""SIGTERM stops a whole TE within seconds; a dead parent takes its TE along."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # starts process trees


def _start_host(model: Path, *flags: str) -> tuple[subprocess.Popen, dict]:
    host = subprocess.Popen([sys.executable, "-m", "tests.engine.te_host", str(model), *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = host.stdout.readline()
    assert line, "the TE host printed nothing"
    return host, json.loads(line)


def _is_running(pid: int) -> bool:
    try:  # it may exit between two psutil calls (seen in CI: NoSuchProcess)
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _is_running(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("sig,flags", [(signal.SIGTERM, ()), (signal.SIGKILL, ("--no-handler",))],
                         ids=["sigterm-host", "sigkill-host"])
def test_te_stops_with_its_host(tiny_model, sig, flags):
    host, info = _start_host(tiny_model, *flags)
    pids = list(info["pids"].values())
    try:
        time.sleep(1.0)  # let it serve a little
        host.send_signal(sig)
        host.wait(timeout=15)
        assert _wait_gone(pids, timeout=10) == []
        assert not [p for p in Path("/dev/shm").iterdir() if info["run_id"] in p.name]
        if sig == signal.SIGTERM:  # a clean stop also removes the run directory
            assert not Path(info["run_dir"]).exists()
    finally:
        for pid in [host.pid] + pids:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
        host.wait(timeout=5)
        for seg in Path("/dev/shm").glob(f"*{info['run_id']}*"):  # a failed check above
            seg.unlink(missing_ok=True)  # left a SIGKILLed host's segments (seen in CI)
        shutil.rmtree(info["run_dir"], ignore_errors=True)  # a killed host cannot
