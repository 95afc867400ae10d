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


def test_tasks_of_a_te_that_leaves_fail_retryable_until_attempts_run_out(rig):
    """te_lost: the gateway may resume the request (as attempt 1, 2, ...); at
    the last attempt the error is final (engine_dead), and past it the JE
    refuses the request."""
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    for attempt, error in ((0, "te_lost"), (2, "engine_dead")):
        rig["to_je"].put(SubmitRequest(request_id=f"r{attempt}", prompt="some prompt",
                                       sampling=SamplingParams(max_tokens=4), attempt=attempt,
                                       reply_to=rig["addr"]["gw"]))
        assert _pump(rig, lambda: _recv(rig["te"]["te0"])).attempt == attempt
        _publish(rig, [])
        failed = _pump(rig, lambda: _recv(rig["gw"]))
        assert failed.request_id == f"r{attempt}" and failed.error == error
        assert "te0" in failed.message
        _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    rig["to_je"].put(SubmitRequest(request_id="r3", prompt="x", attempt=3,
                                   sampling=SamplingParams(max_tokens=4),
                                   reply_to=rig["addr"]["gw"]))
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert failed.error == "engine_dead" and "giving up after 3 attempts" in failed.message


def test_pd_aware_routing_follows_the_heatmap(tiny_model):
    """Algorithm 1: a long prompt with a short output goes to the prefill/decode
    pair (the decode TE gets it with prefill_from = the prefill TE's inbox), a
    short prompt with a long output to the colocated TE; when the prefill TE
    leaves, the job's request fails and its decode task is aborted."""
    from deepserve.control.decode_predictor import DecodeLengthPredictor
    from deepserve.control.pd_heatmap import Heatmap
    from deepserve.control.pd_policy import PDPolicy
    tok = Tokenizer(tiny_model)
    long_prompt = "def handler(request):\n    return request.headers\n" * 60
    short_prompt = "Tell me a story"
    pairs = [(tok.encode(long_prompt + str(i)), 20) for i in range(20)]
    pairs += [(tok.encode(short_prompt + " " * i), 700) for i in range(20)]
    predictor = DecodeLengthPredictor.train(pairs, num_buckets=8, epochs=100)
    heatmap = Heatmap(prompt_len_edges=[0, 256, 100000], ratio_edges=[0, 0.5, 1000],
                      values=[[-0.2, -0.3], [0.5, -0.1]])
    d = tempfile.mkdtemp(prefix="dspd")
    ctx = zmq.Context()
    addr = {n: f"ipc://{d}/{n}.sock" for n in ("je", "cm", "gw", "c0", "p0", "d0")}
    cm = PubSocket(ctx, addr["cm"], bind=True)
    je = JobExecutor(ctx, addr["je"], addr["cm"], str(tiny_model), Router("combined"),
                     PDPolicy("heatmap", heatmap, predictor))
    tes = {t: PullSocket(ctx, addr[t], bind=True, type=_TE_IN) for t in ("c0", "p0", "d0")}
    rig = {"je": je, "to_je": PushSocket(ctx, addr["je"], bind=False), "addr": addr,
           "gw": PullSocket(ctx, addr["gw"], bind=True, type=ToClient)}
    types = {"c0": "colocated", "p0": "prefill", "d0": "decode"}

    def publish(names):
        cm.put(TEList(tes=[TEInfo(te_id=t, te_type=types[t], model="m", address=addr[t])
                           for t in names]))
    try:
        _pump(rig, lambda: publish(types) or (len(je.te_sockets) == 3 or None))
        _submit(rig, "long", long_prompt)
        task = _pump(rig, lambda: _recv(tes["d0"]))
        assert task.request_id == "long" and task.prefill_from == addr["p0"]
        _submit(rig, "short", short_prompt)
        task = _pump(rig, lambda: _recv(tes["c0"]))
        assert task.request_id == "short" and task.prefill_from is None
        publish(["c0", "d0"])  # the prefill TE leaves while "long" runs
        failed = _pump(rig, lambda: _recv(rig["gw"]))
        assert failed.request_id == "long" and failed.error == "te_lost"  # resumable
        abort = _pump(rig, lambda: _recv(tes["d0"]))
        assert isinstance(abort, AbortRequest) and abort.request_id == "long"
        # With no prefill TE left, the long prompt goes to the colocated TE.
        _submit(rig, "long2", long_prompt)
        assert _pump(rig, lambda: _recv(tes["c0"])).request_id == "long2"
    finally:
        je.close()
        for sock in [cm, rig["to_je"], rig["gw"], *tes.values()]:
            sock.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)
