"""The supervisor on a real node: a killed or stalled worker is detected,
its TE replaced, and the request it was serving resumes on the other TE
with exactly the tokens it would have had; a crash loop gives up loudly;
gang scheduling evicts lower-priority TEs. Health-log events are asserted."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepserve import LLM, SamplingParams
from deepserve.supervisor.health_log import read_events
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, SupervisorConfig, TESpec
from deepserve.ipc.sockets import free_port
from tests.supervisor.test_node import _client, _metrics, _shm

pytestmark = pytest.mark.slow  # real process trees on the tiny model

PROMPT = "def handler(request):\n    return request.headers\n"
TE_OPTIONS = {"max_num_batched_tokens": 128, "num_kv_blocks": 128}
SUP = SupervisorConfig(heartbeat_deadline_s=3.0, progress_deadline_s=3.0, startup_grace_s=60,
                       restart_base_delay_s=0.2, max_restarts=2, restart_window_s=60,
                       kill_grace_s=2.0, drill=True)


@pytest.fixture(scope="module")
def node(tiny_model):
    config = NodeConfig.build(model=str(tiny_model), served_model="tiny", port=free_port(),
                              startup_timeout_s=120, te_timeout_s=5,
                              supervisor=SUP,
                              tes=[TESpec(f"te{i}", "colocated", TE_OPTIONS) for i in range(2)])
    node = Node(config)
    node.start()
    yield node
    node.stop()
    assert _shm(node) == set()


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(str(tiny_model), num_kv_blocks=256)
    yield llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0,
                                                ignore_eos=True))[0].token_ids
    llm.shutdown()


def _events(node, since: float = 0.0, **match) -> list[dict]:
    out = []
    for e in read_events(node.log_dir / "health.jsonl"):
        if _epoch(e["time"]) >= since and all(e.get(k) == v for k, v in match.items()):
            out.append(e)
    return out


def _epoch(iso: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _wait_event(node, since: float, timeout: float, **match) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _events(node, since, **match)
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no {match} in the health log: {_events(node, since)}")


def _pid(node, component: str) -> int:
    return [e for e in _events(node, component=component, event="started")][-1]["pid"]


def _serving_te(node) -> str:
    """The TE whose report shows a running request (reports come every 0.5 s)."""
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        m = _metrics(node)
        busy = [dict(labels)["te_id"] for (name, labels), v in m.items()
                if name == "deepserve_te_requests_running" and v > 0]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.1)
    raise AssertionError("no single TE is serving the request")


def _stream_ids(node, fault) -> tuple[list[int], float, str]:
    """Stream one greedy completion; after its 5th token, fault(te) the TE serving it."""
    stream = _client(node).completions.create(model="tiny", prompt=PROMPT, max_tokens=40,
                                              temperature=0, logprobs=1, stream=True,
                                              extra_body={"return_tokens_as_token_ids": True})
    ids, fault_at, te = [], None, None
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs:
                ids += [int(t.split(":")[1]) for t in c.logprobs.tokens]
        if fault_at is None and len(ids) >= 5:
            te = _serving_te(node)
            fault_at = time.time()
            fault(te)
    return ids, fault_at, te


@pytest.mark.parametrize("how", ["sigkill", "stall"])
def test_lost_worker_is_replaced_and_its_request_resumes(node, reference, how):
    _wait_recovered(node)
    for te in ("te0", "te1"):  # slow steps: the fault lands mid-stream
        (node.drill_dir / f"{te}.worker0.slow").write_text("0.1")

    def fault(te):
        if how == "sigkill":
            os.kill(_pid(node, f"{te}/worker0"), signal.SIGKILL)
        else:
            (node.drill_dir / f"{te}.worker0.stall").write_text("")
    try:
        ids, fault_at, te = _stream_ids(node, fault)
    finally:
        for f in node.drill_dir.iterdir():
            f.unlink()
    assert ids == reference  # no gap, no repeat: resumed on the other TE from token k
    migrated = _wait_event(node, fault_at, 5, event="request_migrated")
    assert migrated["details"]["attempt"] == 1 and migrated["details"]["te_id"] != te
    kind = "crashed" if how == "sigkill" else "hung"
    detected = _wait_event(node, fault_at, 15, event=kind)
    detect_s = _epoch(detected["time"]) - fault_at
    bound = 2 * SUP.progress_deadline_s if how == "stall" else 5.0
    assert detect_s <= bound, detect_s
    _wait_event(node, fault_at, 15, component=te, event="restarting")
    recovered = _wait_event(node, fault_at, 60, component=te, event="recovered")
    assert _epoch(recovered["time"]) - fault_at < 60


def _wait_recovered(node):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not node.supervisor.incidents:
            return
        time.sleep(0.2)
    raise AssertionError(f"still recovering: {node.supervisor.incidents}")


def test_crash_loop_gives_up_loudly(node):
    _wait_recovered(node)
    node.supervisor.policy.reset("te1")  # earlier tests' restarts of te1 may be in the window
    t0 = time.time()
    (node.drill_dir / "te1.crash").write_text("")  # every restart of te1 dies at once
    os.kill(node.procs["te1"].pid, signal.SIGKILL)
    failed = _wait_event(node, t0, 60, component="te1", event="failed")
    assert "crash loop" in failed["details"]["reason"]
    # one "crashed" per incident: the TE's host, or (first) one of its processes
    crashes = [e for e in _events(node, t0, event="crashed")
               if e["component"].split("/")[0] == "te1"]
    assert len(crashes) == SUP.max_restarts + 1
    assert len(_events(node, t0, component="te1", event="restarting")) == SUP.max_restarts
    time.sleep(1.0)
    assert node.procs["te1"].poll() is not None  # stays down
    # The node still serves on te0.
    out = _client(node).completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_gang_scheduling_evicts_lower_priority_tes(tiny_model):
    config = NodeConfig.build(model=str(tiny_model), served_model="tiny", port=free_port(),
                              startup_timeout_s=300, num_devices=2,
                              tes=(TESpec("te0", "colocated", TE_OPTIONS, priority=0),
                                   TESpec("te1", "colocated", TE_OPTIONS, priority=0),
                                   TESpec("te2", "colocated", {**TE_OPTIONS, "tp": 2}, priority=1),
                                   TESpec("te3", "colocated", TE_OPTIONS, priority=0)))
    node = Node(config)
    try:
        node.start()
        evicted = _events(node, event="evicted")
        assert sorted(e["component"] for e in evicted) == ["te0", "te1"]
        assert all("te2 (priority 1) needs 2 devices" in e["details"]["reason"] for e in evicted)
        refused = _events(node, component="te3", event="failed")
        assert refused and "not started" in refused[0]["details"]["reason"]
        assert sorted(node.procs) == ["cluster-manager", "gateway", "job-executor", "te2"]
        out = _client(node).completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
    finally:
        node.stop()
