"""A job executor over real ZeroMQ sockets: a test PUB plays the cluster
manager, test PULL sockets play two TEs, the gateway and the KV tier service."""

import shutil
import tempfile
import time
from pathlib import Path

import zmq

from deepserve.config.node import RouterSection
from deepserve.control.je.je_settings import JESettings
from deepserve.control.je.job_executor import JobExecutor
from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket
from deepserve.messages.cache import ToTier
from deepserve.messages.control import TEInfo, TEList
from deepserve.messages.engine import AbortRequest, SubmitRequest, ToClient
from deepserve.tokenizer import Tokenizer

_TE_IN = SubmitRequest | AbortRequest


def je_settings(inbox: str, cm_pub: str, models, **fields) -> JESettings:
    """A JE's settings as load_settings gives them, with 3 attempts and the
    default [router]; models: one model directory, or name -> directory."""
    if not isinstance(models, dict):
        models = {Path(models).name: str(models)}
    return JESettings(**{"inbox": inbox, "cm_pub": cm_pub, "models": models, "max_attempts": 3,
                         "router": RouterSection(), **fields})


def make_rig(tiny_model):
    d = tempfile.mkdtemp(prefix="dsje")
    ctx = zmq.Context()
    addr = {n: f"ipc://{d}/{n}.sock" for n in ("je", "cm", "gw", "te0", "te1", "kvc")}
    cm = PubSocket(ctx, addr["cm"], bind=True)
    events = []
    je = JobExecutor(ctx, je_settings(addr["je"], addr["cm"], tiny_model,
                                      router=RouterSection(isolate_suspects=True),
                                      kv_cache=addr["kvc"], contexts_path=f"{d}/contexts.json"),
                     events=lambda event, **details: events.append((event, details)))
    je.links.fence_s = 0.0  # TEs "restart" here at once; test_a_te_that_just_failed_is_fenced
    rig = {"ctx": ctx, "addr": addr, "cm": cm, "je": je, "events": events,
           "gw": PullSocket(ctx, addr["gw"], bind=True, type=ToClient),
           "to_je": PushSocket(ctx, addr["je"], bind=False),
           "te": {t: PullSocket(ctx, addr[t], bind=True, type=_TE_IN) for t in ("te0", "te1")},
           "tok": Tokenizer(tiny_model),
           "kvc": PullSocket(ctx, addr["kvc"], bind=True, type=ToTier)}
    yield rig
    je.close()
    for sock in [cm, rig["gw"], rig["to_je"], rig["kvc"], *rig["te"].values()]:
        sock.close()
    ctx.term()
    shutil.rmtree(d, ignore_errors=True)


def _publish(rig, tes, down=None):
    """A TE list of `tes`; down: TE id -> the part it went down with. The first
    list is sent again until the JE holds it: its SUB may not have joined yet
    (a PUB drops what it sends before then)."""
    msg = TEList(tes=[TEInfo(te_id=t, model="m", address=rig["addr"][t]) for t in tes],
                 down=down or {})
    rig["cm"].put(msg)
    deadline = time.monotonic() + 5.0
    while not rig["je"].links.has_list and time.monotonic() < deadline:
        rig["je"].step(20)
        if not rig["je"].links.has_list:
            rig["cm"].put(msg)


def _pump(rig, until, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rig["je"].step(20)
        got = until()
        if got is not None:
            return got
    raise AssertionError("timed out")
