"""A real node whose gateway is SIGSTOPped: the supervisor hears its
heartbeats stop, kills it, starts a new one on the same port, and the node
serves again; the TE is untouched, even though it was streaming thousands
of deltas to the stopped gateway (its replies never block: ipc/outboxes.py). Needs the gateway's heartbeat (ActorLife
with component "gateway" in gateway/__main__.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

import pytest

from deepserve.ipc.sockets import free_port
from deepserve.supervisor.health_log import read_events
from deepserve.supervisor.node import Node, num_tes
from deepserve.supervisor.node_config import NodeConfig, SupervisorConfig, TESpec
from tests.supervisor.test_node import _client

TE_OPTIONS = {"max_num_batched_tokens": 128, "num_kv_blocks": 128}
SUP = SupervisorConfig(heartbeat_deadline_s=2.0, progress_deadline_s=3.0, startup_grace_s=60,
                       restart_base_delay_s=0.2, max_restarts=2, restart_window_s=60,
                       kill_grace_s=1.0)


def _events(node, component: str) -> list[dict]:
    return [e for e in read_events(node.log_dir / "health.jsonl") if e["component"] == component]


def _stream_until_cut(url: str, sent: list[int]) -> None:
    """Stream a long completion; the stopped gateway's death cuts it."""
    body = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 1900,
            "temperature": 1.0, "stream": True, "n": 8}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                sent[0] += 1
    except httpx.HTTPError:
        pass


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_stopped_gateway_is_detected_and_restarted(tiny_model):
    config = NodeConfig.build(model=str(tiny_model), served_model="tiny", port=free_port(),
                              startup_timeout_s=120, te_timeout_s=5, supervisor=SUP,
                              tes=[TESpec("te0", "colocated", TE_OPTIONS)])
    node = Node(config)
    node.start()
    try:
        old_pid = node.procs["gateway"].pid
        time.sleep(1.0)  # it serves, so its Ready is sent: the heartbeat deadline applies
        received = [0]
        streams = [threading.Thread(target=_stream_until_cut, args=(node.url, received))
                   for _ in range(4)]
        for t in streams:
            t.start()
        _wait(lambda: received[0] >= 40, 30, "the streams to start")
        stopped_at = time.monotonic()
        os.kill(old_pid, signal.SIGSTOP)
        _wait(lambda: len([e for e in _events(node, "gateway") if e["event"] == "started"]) >= 2,
              SUP.heartbeat_deadline_s + 15, "a new gateway")
        detect_s = time.monotonic() - stopped_at
        seq = [e["event"] for e in _events(node, "gateway")]
        # detected by its silence: no beats, or (a loop busy with 32 streams) no progress
        assert seq in (["started", detected, "restarting", "killed", "started"]
                       for detected in ("heartbeat_missed", "hung")), seq
        missed, killed = _events(node, "gateway")[1], _events(node, "gateway")[3]
        assert missed["pid"] == old_pid and killed["details"]["how"] == "killed"
        assert detect_s <= SUP.heartbeat_deadline_s + SUP.kill_grace_s + 10, detect_s
        assert node.procs["gateway"].pid != old_pid
        _wait(lambda: (num_tes(node.url) or 0) >= 1, 60, "the new gateway to list the TE")
        out = _client(node).completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
        assert [e["event"] for e in _events(node, "te0")] == ["started"]  # untouched
        assert node.supervisor.failed == set()
        for t in streams:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in streams)
    finally:
        node.stop()
