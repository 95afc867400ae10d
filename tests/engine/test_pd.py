"""Prefill/decode disaggregation between two process-mode TEs, no JE: the
test plays the job executor (it sends the decode task with prefill_from)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch
import zmq

from deepserve import LLM, SamplingParams
from deepserve.config import EngineConfig
from deepserve.engine.te.launcher import TELauncher
from deepserve.ipc.segments import create_segment, segment_name, unlink_segment
from deepserve.ipc.sockets import PullSocket, PushSocket, ipc_address
from deepserve.messages.control import TEReport, ToClusterManager
from deepserve.messages.engine import RequestDelta, RequestFailed, SubmitRequest, ToClient
from deepserve.messages.pd import KVAck, KVEndpoint, KVReady, PrefillOrder
from deepserve.model.config import load_model_config

pytestmark = pytest.mark.slow  # starts process trees

PROMPTS = [
    "def fibonacci(n):\n    " * 6,
    "The quick brown fox",
    "import os\nimport sys\n" * 12,
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
]


def _ids(client: PullSocket, n: int, timeout: float = 60.0) -> dict[str, list[int] | str]:
    """Collect n requests' token ids (or 'failed: ...') from a reply socket."""
    out: dict[str, list[int] | str] = {}
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < n:
        msg = client.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(msg, RequestFailed):
            out[msg.request_id] = f"failed: {msg.error}: {msg.message}"
            done.add(msg.request_id)
        elif isinstance(msg, RequestDelta):
            out.setdefault(msg.request_id, []).extend(msg.token_ids)
            if msg.finish_reason is not None:
                done.add(msg.request_id)
    return out


class Pair:
    """A prefill TE and a decode TE with known inboxes, and a reply socket."""

    def __init__(self, model: str, tmp_path, report: bool = False, **options):
        self.ctx = zmq.Context()
        self.tes = {}
        if report:  # the prefill TE's reports (kv usage) come here
            address = ipc_address(tmp_path, "reports")
            self.reports = PullSocket(self.ctx, address, bind=True, type=ToClusterManager)
        for role in ("p", "d"):
            cfg = EngineConfig.from_options(str(model), processes=True, num_kv_blocks=96,
                                            max_num_batched_tokens=64, startup_timeout_s=90,
                                            **options)
            self.tes[role] = TELauncher(cfg, te_id=f"te-{role}",
                                        inbox_address=ipc_address(tmp_path, f"in-{role}"),
                                        report_address=address if report and role == "p"
                                        else None)
        self.reply = ipc_address(tmp_path, "reply")
        self.client = PullSocket(self.ctx, self.reply, bind=True, type=ToClient | KVReady)
        try:
            for te in self.tes.values():
                te.start()
        except BaseException:
            self.close()
            raise
        self.to_d = PushSocket(self.ctx, self.tes["d"].address["tokenizer"], bind=False)

    def submit(self, request_id: str, prompt: str, sampling: SamplingParams) -> None:
        self.to_d.put(SubmitRequest(request_id=request_id, prompt=prompt, sampling=sampling,
                                    reply_to=self.reply,
                                    prefill_from=self.tes["p"].address["tokenizer"]))

    def close(self) -> None:
        for te in self.tes.values():
            te.shutdown()
        for sock in ("client", "to_d", "reports"):
            if hasattr(self, sock):
                getattr(self, sock).close()
        self.ctx.term()


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(str(tiny_model), num_kv_blocks=256)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("options", [{}, {"kv_transfer_layerwise": True},
                                     {"kv_transfer_backend": "tcp"}],
                         ids=["by-request", "layerwise", "tcp"])
def test_disaggregated_equals_colocated(tiny_model, tmp_path, reference, options):
    pair = Pair(tiny_model, tmp_path, **options)
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        for i, prompt in enumerate(PROMPTS):
            pair.submit(f"r{i}", prompt, params)
        got = _ids(pair.client, len(PROMPTS))
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
        # The same prompts again: the decode TE adopted the blocks into its
        # prefix tree, so the second time only the uncached rest is ordered.
        for i, prompt in enumerate(PROMPTS):
            pair.submit(f"again{i}", prompt, params)
        again = _ids(pair.client, len(PROMPTS))
        assert [again[f"again{i}"] for i in range(len(PROMPTS))] == reference
    finally:
        pair.close()


def test_the_models_defaults_hold_on_both_sides_of_a_disaggregated_request(tiny_model,
                                                                           tmp_path):
    """Unset fields resolved by the decode TE (greedy, a repetition penalty
    below 1: seen tokens are favoured, so it shows in 10 tokens,
    max_new_tokens 10): the prefill TE samples the first token with them,
    over the prompt it was sent, so the output is the colocated one."""
    from tests.engine.test_generation_defaults import variant
    model = variant(tiny_model, tmp_path / "m", temperature=0.0, repetition_penalty=0.5,
                    max_new_tokens=10)
    unset = SamplingParams(ignore_eos=True)
    llm = LLM(str(model), num_kv_blocks=256)
    expected = [out.token_ids for out in llm.generate(PROMPTS, unset)]
    plain = [out.token_ids for out in llm.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.0))]
    assert all(len(ids) == 10 for ids in expected)
    assert any(e[0] != p[0] for e, p in zip(expected, plain))  # the prefill TE's token too
    pair = Pair(model, tmp_path)
    try:
        for i, prompt in enumerate(PROMPTS):
            pair.submit(f"r{i}", prompt, unset)
        got = _ids(pair.client, len(PROMPTS))
    finally:
        pair.close()
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected


def test_unacknowledged_kv_is_freed_and_acknowledged_kv_at_once(tiny_model, tmp_path):
    """The test plays a decode TE that orders KV into its own pool segment.
    The prefill TE writes the blocks, reports KVReady with the first token,
    and holds its copy until the KVAck, or until the transfer timeout when
    no ack comes (the decode TE died after ordering)."""
    pair = Pair(tiny_model, tmp_path, kv_transfer_timeout_s=2.0, report=True)
    p = pair.tes["p"]
    mc = load_model_config(tiny_model)
    shape = (2, mc.num_layers, mc.num_kv_heads, 96, 16, mc.head_dim)
    name = segment_name(uuid.uuid4().hex[:8], "fake-decode-kv")
    seg = create_segment(name, mc.dtype.itemsize * int(torch.Size(shape).numel()))
    to_p = PushSocket(pair.ctx, p.address["pd"], bind=False)  # master to master
    try:
        pool = torch.frombuffer(seg.buf, dtype=mc.dtype).view(shape)
        ep = KVEndpoint(shape=shape, dtype=str(mc.dtype).removeprefix("torch."), shm=name)
        ids = list(range(5, 45))  # 3 blocks
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        for request_id in ("acked", "orphan"):
            to_p.put(PrefillOrder(request_id=request_id, prompt_token_ids=ids, sampling=params,
                                  skip_blocks=0, dst_block_ids=[10, 11, 12], dst_te="fake",
                                  dst_endpoints=[ep], reply_to=pair.reply))
            ready = pair.client.get(timeout=60)
            assert isinstance(ready, KVReady) and ready.error is None, ready
            assert ready.reply_to == p.address["pd"] and ready.order_id == 0
            assert ready.nbytes == 3 * pool[:, :, :, 0].numel() * mc.dtype.itemsize
            assert pool[:, :, :, 10:13].abs().sum() > 0  # the KV landed in our pool
            assert pool[:, :, :, 13:].abs().sum() == 0  # and nowhere else
            held = _wait_usage(pair, lambda u: u > 0, 5)
            assert held > 0
            if request_id == "acked":
                to_p.put(KVAck(request_id="acked"))
                t0 = time.monotonic()
                _wait_usage(pair, lambda u: u == 0, 2)
                assert time.monotonic() - t0 < 1.5  # at the next report, not the timeout
            else:
                t0 = time.monotonic()
                _wait_usage(pair, lambda u: u == 0, 6)
                assert 1.0 < time.monotonic() - t0 < 4.0  # freed by the 2 s timeout
        assert ready.token_id >= 0
    finally:
        to_p.close()
        del pool
        seg.close()
        unlink_segment(name)
        pair.close()


def test_decode_task_fails_cleanly_when_prefill_te_is_dead(tiny_model, tmp_path):
    pair = Pair(tiny_model, tmp_path, kv_transfer_timeout_s=2.0)
    try:
        os.kill(pair.tes["p"].pids["master"], signal.SIGKILL)
        pair.tes["p"].children[1].process.join(5)
        t0 = time.monotonic()
        pair.submit("lost-prefill", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0))
        got = _ids(pair.client, 1, timeout=10)
        assert got["lost-prefill"].startswith("failed: kv_transfer_failed"), got  # retryable
        assert time.monotonic() - t0 < 5
        # The decode TE itself is fine: a colocated request still completes.
        pair.to_d.put(SubmitRequest(request_id="after", prompt=PROMPTS[1],
                                    sampling=SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                                    reply_to=pair.reply))
        assert len(_ids(pair.client, 1)["after"]) == 4
    finally:
        pair.close()


def _wait_usage(pair: "Pair", ok, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = pair.reports.get(timeout=0.5)
        except TimeoutError:
            continue
        if isinstance(msg, TEReport) and ok(msg.kv_usage):
            return msg.kv_usage
    raise AssertionError("kv usage never reached the expected state")
