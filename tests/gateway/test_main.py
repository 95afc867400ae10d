"""`python -m deepserve.gateway` starts, serves, and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from deepserve.ipc.sockets import free_port, ipc_address



def test_main_serves_and_exits_cleanly_on_sigterm():
    run_dir = tempfile.mkdtemp(prefix="dsgw-", dir="/tmp")
    port = free_port()
    argv = [sys.executable, "-m", "deepserve.gateway", "--je", ipc_address(run_dir, "je"),
            "--cm", ipc_address(run_dir, "cm"), "--reply", ipc_address(run_dir, "reply"),
            "--port", str(port), "--model", "m", "--log-level", "warning"]
    env = {**os.environ, "DEEPSERVE_API_KEYS": "k1:t1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 20, None
        while status is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            except httpx.TransportError:
                time.sleep(0.05)
        assert status == 503  # up, but no cluster manager has listed a TE
        assert models.status_code == 401  # the key from DEEPSERVE_API_KEYS is required
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        shutil.rmtree(run_dir, ignore_errors=True)
