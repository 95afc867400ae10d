"""The job executor over real ZeroMQ sockets: a test PUB plays the cluster
manager, test PULL sockets play two TEs and the gateway."""

import shutil
import tempfile
import time

import pytest
import zmq

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.control.job_executor import JobExecutor
from deepserve.control.router import Router
from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket
from deepserve.messages.control import TEInfo, TEList, TEReport
from deepserve.messages.engine import AbortRequest, RequestFailed, SubmitRequest, ToClient
from deepserve.messages.sampling import SamplingParams
from deepserve.tokenizer import Tokenizer

_TE_IN = SubmitRequest | AbortRequest


@pytest.fixture
def rig(tiny_model):
    d = tempfile.mkdtemp(prefix="dsje")
    ctx = zmq.Context()
    addr = {n: f"ipc://{d}/{n}.sock" for n in ("je", "cm", "gw", "te0", "te1")}
    cm = PubSocket(ctx, addr["cm"], bind=True)
    je = JobExecutor(ctx, addr["je"], addr["cm"], str(tiny_model), Router("combined"))
    rig = {"ctx": ctx, "addr": addr, "cm": cm, "je": je,
           "gw": PullSocket(ctx, addr["gw"], bind=True, type=ToClient),
           "to_je": PushSocket(ctx, addr["je"], bind=False),
           "te": {t: PullSocket(ctx, addr[t], bind=True, type=_TE_IN) for t in ("te0", "te1")},
           "tok": Tokenizer(tiny_model)}
    yield rig
    je.close()
    for sock in [cm, rig["gw"], rig["to_je"], *rig["te"].values()]:
        sock.close()
    ctx.term()
    shutil.rmtree(d, ignore_errors=True)


def _publish(rig, tes):
    rig["cm"].put(TEList(tes=[TEInfo(te_id=t, model="m", address=rig["addr"][t]) for t in tes]))


def _pump(rig, until, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rig["je"].step(20)
        got = until()
        if got is not None:
            return got
    raise AssertionError("timed out")


def _recv(sock):
    try:
        return sock.get(timeout=0)
    except TimeoutError:
        return None


def _submit(rig, request_id, prompt, salt=None):
    rig["to_je"].put(SubmitRequest(request_id=request_id, prompt=prompt, salt=salt,
                                   sampling=SamplingParams(max_tokens=4),
                                   reply_to=rig["addr"]["gw"]))


def test_routes_tokenized_tasks_and_follows_cached_prefixes(rig):
    # the PUB drops messages sent before the JE's SUB connects: repeat until heard
    _pump(rig, lambda: _publish(rig, ["te0", "te1"]) or (rig["je"].te_sockets or None))
    prompt = "def handler(request):\n    return request.headers\n" * 8
    ids = rig["tok"].encode(prompt)
    rig["cm"].put(TEReport(te_id="te1", num_waiting=0, num_running=0, load_tokens=0,
                           kv_usage=0.0, inserted=prompt_block_hashes(ids, 16)))
    _pump(rig, lambda: rig["je"].router.index.num_hashes("te1") or None)
    _submit(rig, "r1", prompt)
    task = _pump(rig, lambda: _recv(rig["te"]["te1"]))
    assert task.request_id == "r1" and task.prompt_token_ids == ids
    assert task.reply_to == rig["addr"]["gw"]
    rig["to_je"].put(AbortRequest(request_id="r1"))
    assert isinstance(_pump(rig, lambda: _recv(rig["te"]["te1"])), AbortRequest)


def test_no_te_and_bad_input_fail_to_the_gateway(rig):
    _submit(rig, "r2", "hello")
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert isinstance(failed, RequestFailed) and failed.error == "engine_dead"
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    _submit(rig, "r3", "")
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert failed.error == "invalid_request" and failed.param == "prompt"


def test_tasks_of_a_te_that_leaves_fail(rig):
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    _submit(rig, "r4", "some prompt")
    _pump(rig, lambda: _recv(rig["te"]["te0"]))
    _publish(rig, [])
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert failed.request_id == "r4" and failed.error == "engine_dead" and "te0" in failed.message
