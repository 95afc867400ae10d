"""The worker's loop under ActorLife, without a model: a fake ring and runner,
a real heartbeat socket standing in for the supervisor, real fault files.

holds_work is real: False while idle, True from taking a batch until its
StepDone is out; the stall drill stops the worker inside a step, where it
keeps beating with holds_work True and its progress frozen."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from deepserve.actor import ActorLife
from deepserve.config import EngineConfig
from deepserve.faults import FaultHooks
from deepserve.ipc.segments import create_segment, segment_name, unlink_segment
from deepserve.ipc.sockets import PullSocket
from deepserve.messages.engine import StepDone
from deepserve.messages.health import HealthEvent, Heartbeat
from deepserve.messages.pd import KVEndpoint, KVTransferOrder
from deepserve.messages.step import SHUTDOWN_STEP_ID, StepBatch, StepOutput
from deepserve.worker.kv_sender import KVSender
from deepserve.worker.spec import WorkerSpec
from deepserve.worker.worker_actor import _Worker


class FakeRing:
    def __init__(self):
        self.batches: queue.Queue[bytes] = queue.Queue()

    def put(self, batch: StepBatch) -> None:
        self.batches.put(msgspec.msgpack.encode(batch))

    def get(self, timeout: float) -> bytes:
        try:
            return self.batches.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None

    def close(self) -> None:
        pass


class FakeRunner:
    def __init__(self, worker):
        self.worker, self.holds_work_seen = worker, []

    def execute(self, batch: StepBatch, after_layer=None) -> StepOutput:
        self.holds_work_seen.append(self.worker.holds_work())
        return StepOutput(batch.step_id, [])


class FakeOut:
    def __init__(self):
        self.sent = []

    def put(self, msg) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        pass


@pytest.fixture
def supervisor(supervisor_inbox):
    return supervisor_inbox


def _wait_for(inbox: PullSocket, ok, timeout: float = 5.0) -> list:
    """Messages received until one satisfies ok (AssertionError if none does)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = inbox.get(timeout=0.1)
        except TimeoutError:
            continue
        seen.append(msg)
        if ok(msg):
            return seen
    raise AssertionError(f"not received in {timeout} s; got {seen}")


def _beat(holds_work: bool, steps: int, layers: int = 0):
    return lambda m: (isinstance(m, Heartbeat) and m.holds_work is holds_work
                      and m.progress == {"steps": steps, "layers": layers, "layer_waits": 0,
                                         "grammar_waits": 0})


def test_holds_work_is_real_and_a_stalled_step_keeps_beating(supervisor):
    life = ActorLife("worker0", component="te/worker0", signals=False)
    spec = WorkerSpec("run", 0, EngineConfig(model="unused"), "ring", "ipc://unused",
                      "ipc://unused", "tcp://unused", te_id="te")
    worker = _Worker(spec, life)
    worker.ring, worker.runner, worker.out = FakeRing(), FakeRunner(worker), FakeOut()
    loop = threading.Thread(target=life.run,
                            args=(worker.step, worker.progress, worker.holds_work))
    time.sleep(0.2)  # the heartbeat PUSH drops what it cannot queue at once
    loop.start()
    try:
        _wait_for(supervisor.inbox, _beat(False, 0))  # idle: holds no work
        worker.ring.put(StepBatch(0, []))
        _wait_for(supervisor.inbox, _beat(False, 1), timeout=3)
        assert worker.runner.holds_work_seen == [True]  # inside the step
        assert [m.output.step_id for m in worker.out.sent] == [0]

        stall = supervisor.drills / "te.worker0.stall"
        stall.write_text("")
        worker.ring.put(StepBatch(1, []))
        got = _wait_for(supervisor.inbox, _beat(True, 1))  # at once: holds_work flipped
        assert any(isinstance(m, HealthEvent) and m.event == "fault_injected"
                   and m.details["fault"] == "stall" for m in got)
        t0 = time.monotonic()
        _wait_for(supervisor.inbox, _beat(True, 1), timeout=2)  # and again while stalled
        assert time.monotonic() - t0 > 0.3  # (a later beat, not one queued with the first)
        assert len(worker.out.sent) == 1  # no StepDone while stalled
        stall.unlink()
        _wait_for(supervisor.inbox, _beat(False, 2))
        assert [m.output.step_id for m in worker.out.sent] == [0, 1]
        assert all(isinstance(m, StepDone) for m in worker.out.sent)
        worker.ring.put(StepBatch(SHUTDOWN_STEP_ID, []))
        loop.join(timeout=5)
        assert not loop.is_alive() and worker.num_steps == 2
    finally:
        life.request_stop()
        loop.join(timeout=5)
        worker.close()
        life.close()


class SlowLayersRunner:
    """A step of 6 layers of 0.3 s each: longer than a heartbeat interval many times."""
    on_layer = None

    def execute(self, batch: StepBatch, after_layer=None) -> StepOutput:
        for i in range(6):
            time.sleep(0.3)
            self.on_layer(i)
        return StepOutput(batch.step_id, [])


def test_a_long_step_beats_between_layers_with_progress(supervisor):
    """A big model's long prefill step is alive and progressing to the
    supervisor: beats inside the step, holding work, the layer count moving."""
    life = ActorLife("worker0", component="te/worker0", signals=False)
    spec = WorkerSpec("run", 0, EngineConfig(model="unused"), "ring", "ipc://unused",
                      "ipc://unused", "tcp://unused", te_id="te")
    worker = _Worker(spec, life)
    worker.ring, worker.out = FakeRing(), FakeOut()
    worker.attach_runner(SlowLayersRunner())
    loop = threading.Thread(target=life.run,
                            args=(worker.step, worker.progress, worker.holds_work))
    time.sleep(0.2)
    loop.start()
    try:
        _wait_for(supervisor.inbox, _beat(False, 0))
        worker.ring.put(StepBatch(0, []))
        got = _wait_for(supervisor.inbox, _beat(False, 1, 6), timeout=5)
        inside = [m.progress["layers"] for m in got if isinstance(m, Heartbeat)
                  and m.holds_work and m.progress["steps"] == 0]
        assert len(inside) >= 2 and inside == sorted(inside) and inside[-1] > inside[0]
        assert inside[-1] < 6  # beats came while the step was still computing
    finally:
        life.request_stop()
        loop.join(timeout=5)
        worker.close()
        life.close()


class _Runner:
    def execute(self, batch: StepBatch, after_layer=None) -> StepOutput:
        return StepOutput(batch.step_id, [])


def test_kv_fail_fault_fails_exactly_the_next_transfer(short_dir):
    """consume("kv-fail") returns "" for an empty file: the fault must fire
    anyway (tested `is not None`), once, and the transfer after it works."""
    shape = (2, 2, 1, 4, 4, 8)
    pool = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    name = segment_name(uuid.uuid4().hex[:8], "peer-kv")
    seg = create_segment(name, pool.numel() * 4)
    ctx = zmq.Context()
    faults = FaultHooks(short_dir, "te/worker0")
    config = SimpleNamespace(kv_transfer_backend="shm", kv_transfer_timeout_s=5.0)
    sender = KVSender(pool, segment_name("x", "own-kv"), 0, config, ctx, faults)
    try:
        peer = torch.frombuffer(seg.buf, dtype=torch.float32).view(shape)
        ep = KVEndpoint(shape=shape, dtype="float32", shm=name)
        batch = StepBatch(0, [], transfers=[KVTransferOrder(7, "te-d", [ep], [1, 2], [0, 3])])
        faults.path("kv-fail").write_text("")
        _, [sent] = sender.execute(_Runner(), batch)
        assert sent.error == "drill: transfer broken mid-way" and sent.nbytes == 0
        assert not faults.path("kv-fail").exists() and faults.num_fired == 1
        assert peer.abs().sum() == 0  # nothing was written
        _, [sent] = sender.execute(_Runner(), batch)
        assert sent.error is None and sent.nbytes == 2 * pool[:, :, :, 0].numel() * 4
        assert torch.equal(peer[:, :, :, [0, 3]], pool[:, :, :, [1, 2]])
        del peer
    finally:
        sender.close()
        seg.close()
        unlink_segment(name)
        ctx.term()


def test_the_layer_hook_runs_after_each_layer_after_the_transfer_hook(model_dirs):
    """ModelRunner composes the worker's beat with layer-wise KV transfer's
    after_layer: the KV of layer i goes out first, then the beat."""
    from deepserve.messages.step import ScheduledSeq
    from deepserve.model.loader import load_model
    from deepserve.worker.model_runner import ModelRunner
    model = load_model(model_dirs["llama"], "float32")
    runner = ModelRunner(model, 8, 16)
    calls = []
    assert runner._layer_hook(None) is None  # no worker hook, no transfer: nothing
    runner.on_layer = lambda i: calls.append(("beat", i))
    hook = runner._layer_hook(lambda i: calls.append(("kv", i)))
    ids, pos, meta = runner._prepare([ScheduledSeq(0, 0, [5, 6, 7], [1], True)])
    model(ids, pos, meta, runner.kv_caches, hook)
    layers = model.config.num_layers
    assert calls == [(kind, i) for i in range(layers) for kind in ("kv", "beat")]
    assert runner._layer_hook(None) is runner.on_layer
