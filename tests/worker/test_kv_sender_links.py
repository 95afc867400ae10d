"""A prefill worker's links to a decode TE across that TE's restarts: each
incarnation's pool segment (shm) or our staging segment (ring) is released
when the next one is linked, so restarts leak no mapping (counted in
/proc/self/maps)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch
import zmq

from deepserve.faults import NoFaults
from deepserve.ipc.segments import create_segment, segment_name, unlink_segment
from deepserve.messages.pd import KVEndpoint, KVTransferOrder
from deepserve.messages.step import StepBatch, StepOutput
from deepserve.transfer import DistFlowReceiver
from deepserve.worker import kv_sender
from deepserve.worker.kv_sender import KVSender

SHAPE = (2, 2, 1, 4, 4, 8)


class _Runner:
    def execute(self, batch: StepBatch, after_layer=None) -> StepOutput:
        return StepOutput(batch.step_id, [])


def _mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


class _DecodeTE:
    """One incarnation of a decode TE's rank 0: its pool in a fresh segment
    (and a DistFlowReceiver for the ring backend)."""

    def __init__(self, ctx: zmq.Context, ring: bool):
        self.name = segment_name(uuid.uuid4().hex[:8], "kv-r0")
        self.segment = create_segment(self.name, torch.Size(SHAPE).numel() * 4)
        self.pool = torch.frombuffer(self.segment.buf, dtype=torch.float32).view(SHAPE)
        self.receiver = DistFlowReceiver(self.pool, ctx=ctx) if ring else None
        tcp = self.receiver.endpoint(shm_name=self.name).tcp if ring else None
        self.endpoint = KVEndpoint(shape=SHAPE, dtype="float32", shm=self.name, tcp=tcp)

    def stop(self) -> None:  # a crash leaves the name to the sweep; we unlink at once
        if self.receiver is not None:
            self.receiver.close()
        self.pool = None
        self.segment.close()
        unlink_segment(self.name)


def _send(sender: KVSender, te: _DecodeTE) -> None:
    order = KVTransferOrder(7, "te-d", [te.endpoint], [1, 2], [0, 3])
    _, [sent] = sender.execute(_Runner(), StepBatch(0, [], transfers=[order]))
    assert sent.error is None and sent.nbytes > 0


@pytest.mark.parametrize("backend", ["shm", "ring"])
def test_a_restarted_decode_te_leaves_no_mapping_behind(backend):
    ctx = zmq.Context()
    pool = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)
    config = SimpleNamespace(kv_transfer_backend=backend, kv_transfer_timeout_s=5.0,
                             kv_bind_host="127.0.0.1")
    sender = KVSender(pool, segment_name("x", "own-kv"), 0, config, ctx, NoFaults())
    incarnations = []
    try:
        for _ in range(3):  # the decode TE restarts twice
            te = _DecodeTE(ctx, ring=backend == "ring")
            incarnations.append(te)
            before = {t.name: _mappings(t.name) for t in incarnations}
            _send(sender, te)
            assert torch.equal(te.pool[:, :, :, 3], pool[:, :, :, 2])  # it arrived
            if len(incarnations) > 1:
                old = incarnations[-2]
                old.stop()
                if backend == "shm":
                    assert before[old.name] == 2  # its owner's and our link's
            assert sender.num_links == 1
        # ours are gone: every stopped incarnation's pool is mapped nowhere here
        for old in incarnations[:-1]:
            assert _mappings(old.name) == 0, old.name
        # (a ring link's staging segment is named after the pool: counted above)
    finally:
        sender.close()
        incarnations[-1].stop()
        ctx.term()


def test_links_are_bounded(monkeypatch):
    monkeypatch.setattr(kv_sender, "MAX_LINKS", 2)
    ctx = zmq.Context()
    pool = torch.zeros(SHAPE)
    config = SimpleNamespace(kv_transfer_backend="shm", kv_transfer_timeout_s=5.0)
    sender = KVSender(pool, segment_name("x", "own-kv"), 0, config, ctx, NoFaults())
    tes = [_DecodeTE(ctx, ring=False) for _ in range(3)]
    try:
        for i, te in enumerate(tes):
            order = KVTransferOrder(i, f"te-{i}", [te.endpoint], [1], [0])
            sender.execute(_Runner(), StepBatch(0, [], transfers=[order]))
        assert sender.num_links == 2 and _mappings(tes[0].name) == 1  # only its owner's
    finally:
        sender.close()
        for te in tes:
            te.stop()
        ctx.term()
