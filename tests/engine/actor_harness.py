"""In-process TE actors on real sockets, for actor-level tests: a Master (no
workers: the test plays rank 0 on its steps socket and the tokenizer on its
tokenizer socket) and a TokenizerActor (the test plays the master and the
callers). Each is stepped by the test, so nothing runs behind its back."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from deepserve.actor import ActorLife
from deepserve.config import EngineConfig
from deepserve.engine.pd.coordinator import PDCoordinator
from deepserve.engine.te.master import Master
from deepserve.engine.te.specs import MasterSpec, TokenizerSpec
from deepserve.engine.te.tokenizer_actor import TokenizerActor
from deepserve.ipc.segments import segment_name
from deepserve.ipc.sockets import PullSocket, PushSocket, ipc_address
from deepserve.messages.engine import ToClient, ToMaster, ToTokenizer
from deepserve.messages.pd import KVEndpoint, ToPeer, pd_address
from deepserve.model.config import load_model_config


def resolved_config(model: str, **options) -> EngineConfig:
    config = EngineConfig.from_options(model, **{"num_kv_blocks": 32, **options})
    mc = load_model_config(config.model, config.dtype)
    return config.resolve(mc.max_position_embeddings,
                          mc.kv_bytes_per_block(config.block_size))


def drain(sock: PullSocket, wait_s: float = 0.3) -> list:
    """Everything that arrives within wait_s of the last message."""
    out = []
    while True:
        try:
            out.append(sock.get(timeout=wait_s))
        except TimeoutError:
            return out


class _ShortPoller:
    """The master waits up to 1 s for a step in flight; the test is rank 0."""

    def __init__(self, poller):
        self.poller = poller

    def poll(self, timeout: int) -> list:
        return self.poller.poll(min(timeout, 50))


class MasterHarness:
    """A Master bound in run_dir; `send` to its inboxes, `step` it, read what
    it told the tokenizer (`to_tokenizer`), the client and peers (`peer`)."""

    def __init__(self, model: str, run_dir: Path, **options):
        self.ctx = zmq.Context()
        a = {n: ipc_address(run_dir, n) for n in ("master", "steps", "tok", "client", "ring")}
        a["pd"] = pd_address(a["tok"])
        a["peer"] = ipc_address(run_dir, "peer")
        self.addresses = a
        spec = MasterSpec(resolved_config(model, **options),
                          segment_name(run_dir.name, "steps"), a["ring"], a["master"],
                          a["steps"], a["tok"], a["client"], a["pd"], te_id="te-m")
        self.to_tokenizer = PullSocket(self.ctx, a["tok"], bind=True, type=ToTokenizer)
        self.client = PullSocket(self.ctx, a["client"], bind=True, type=ToClient)
        self.peer = PullSocket(self.ctx, a["peer"], bind=True, type=ToPeer)
        self.life = ActorLife("master", component="te-m/master", signals=False)
        self.master = Master(spec, self.life)
        cfg = spec.config
        self.master.pd = PDCoordinator(
            self.master.kv, self.master.scheduler, te_id="te-m", tp=1,
            max_model_len=cfg.max_model_len, kv_transfer_timeout_s=cfg.kv_transfer_timeout_s,
            address=a["pd"], endpoints=[KVEndpoint(shape=(1,), dtype="float32", shm="x")])
        self._in = {name: PushSocket(self.ctx, a[name], bind=False)
                    for name in ("master", "steps", "pd")}
        self.master.poller = _ShortPoller(self.master.poller)

    def send(self, inbox: str, msg) -> None:
        """inbox: "master" (requests), "steps" (workers) or "pd" (peers)."""
        self._in[inbox].put(msg, timeout=2)

    def send_raw(self, inbox: str, frame: bytes) -> None:
        self._in[inbox].socket.send(frame)

    def step(self, n: int = 3) -> None:
        for _ in range(n):
            self.master.step()

    def step_until(self, ok, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, "condition not reached"
            self.master.step()

    def close(self) -> None:
        for sock in self._in.values():
            sock.close()
        self.master.close()
        for sock in (self.to_tokenizer, self.client, self.peer):
            sock.close()
        self.ctx.term()
        self.life.close()


class TokenizerHarness:
    """A TokenizerActor bound in run_dir; the test reads what it sends the
    master (`master`) and the default client (`client`)."""

    def __init__(self, model: str, run_dir: Path, **options):
        self.ctx = zmq.Context()
        a = {n: ipc_address(run_dir, n) for n in ("inbox", "master", "client")}
        self.addresses = a
        self.master = PullSocket(self.ctx, a["master"], bind=True, type=ToMaster)
        self.client = PullSocket(self.ctx, a["client"], bind=True, type=ToClient)
        spec = TokenizerSpec(resolved_config(model, **options), a["inbox"], a["master"],
                             a["client"], te_id="te-t")
        self.actor = TokenizerActor(spec, self.ctx)
        self._in = PushSocket(self.ctx, a["inbox"], bind=False)

    def send(self, msg) -> None:
        self._in.put(msg, timeout=2)
        self.actor.step()

    def close(self) -> None:
        self._in.close()
        self.actor.close()
        self.master.close()
        self.client.close()
        self.ctx.term()
