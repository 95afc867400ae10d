"""The TE master: scheduler and RTC control, one step ahead of the workers.

    tokenizer ──AddRequest/FinishRequest──> [requests PULL]
                                                  │
                          Scheduler + KVCacheManager (block tables, radix tree)
                                                  │ StepBatch, encoded once
                                   shared-memory broadcast ring ══> workers
    workers ──StepDone/WorkerReady/WorkerFailed──> [steps PULL]
    master ──StepTokens──> tokenizer (detokenizes, streams to the client)
    master ──RequestFailed──> client (when the workers report a failure)

Pipeline: with async scheduling up to two steps are in flight, so while the
workers run step N the master has already built and sent N+1; synchronous
mode keeps one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from deepserve.actor import ActorLife
from deepserve.cache.kv_manager import KVCacheManager
from deepserve.config import EngineConfig
from deepserve.engine.pd import PDCoordinator
from deepserve.engine.scheduler import Scheduler, SchedulerOutput
from deepserve.engine.sequence import Sequence
from deepserve.ipc.shm_ring import BroadcastRing
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.messages.engine import (AddRequest, EngineStats, FinishRequest, FromWorker,
                                       GetStats, NewTokens, RequestFailed, StepDone,
                                       StepTokens, ToMaster, WorkerFailed, WorkerReady)
from deepserve.messages.pd import KVAck, KVReady, KVSent, PrefillOrder
from deepserve.messages.control import TEReport
from deepserve.messages.step import SHUTDOWN_STEP_ID, StepBatch
from deepserve.drill.hooks import FaultHooks
from deepserve.model.config import load_model_config
from deepserve.supervisor.heartbeat import HeartbeatSender

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MasterSpec:
    config: EngineConfig  # resolved
    ring_name: str
    ring_overflow: str
    requests_address: str
    steps_address: str
    tokenizer_address: str
    client_address: str
    te_id: str = "te"
    report_address: str | None = None  # the cluster manager's inbox, if any
    report_interval_s: float = 0.5


def master_main(spec: MasterSpec, death_pipe: Connection, ready_pipe: Connection) -> None:
    life = ActorLife("master", death_pipe)
    master = Master(spec, life)
    try:
        master.start()
        ready_pipe.send(("ready", None))
        master.wait_for_workers()
        master.loop()
    except Exception as e:
        log.exception("master failed")
        ready_pipe.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1)
    finally:
        master.close()


def _remaining_tokens(seq: Sequence) -> int:
    """Load a sequence still puts on the TE: tokens to compute + tokens to generate."""
    return (seq.num_uncomputed_tokens
            + max(0, seq.sampling.max_tokens - seq.num_output_tokens))


class Master:
    def __init__(self, spec: MasterSpec, life: ActorLife):
        self.spec, self.life, cfg = spec, life, spec.config
        self.model_config = load_model_config(cfg.model, cfg.dtype)
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 record_events=spec.report_address is not None)
        self.num_prompt_tokens = self.num_cached_tokens = 0  # of finished requests
        self.finished_ids: list[str] = []
        self.last_report = 0.0
        self.scheduler = Scheduler(self.kv, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                   cfg.max_model_len)
        self.depth = 2 if cfg.async_scheduling else 1
        self.in_flight: deque[tuple[int, SchedulerOutput]] = deque()
        self.seqs: dict[str, Sequence] = {}  # request id -> sequence
        self.request_ids: dict[int, str] = {}
        self.released: list[int] = []
        self.forward_spans: deque[tuple[float, float]] = deque(maxlen=100_000)
        self.seq_ids, self.step_ids = itertools.count(), itertools.count()
        self.ctx = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self.ring = self.pd = None
        self.heartbeat = HeartbeatSender.from_env(self.ctx, f"{spec.te_id}/master")
        self.hooks = FaultHooks.from_env(f"{spec.te_id}/master")
        self.num_steps = self.num_tokens = 0

    def start(self) -> None:
        s = self.spec
        self.requests = PullSocket(self.ctx, s.requests_address, bind=True, type=ToMaster)
        self.steps = PullSocket(self.ctx, s.steps_address, bind=True, type=FromWorker)
        self.to_tokenizer = PushSocket(self.ctx, s.tokenizer_address, bind=False)
        self.to_client = PushSocket(self.ctx, s.client_address, bind=False)
        self.ring = BroadcastRing.create(s.ring_name, num_readers=s.config.tp,
                                         overflow_address=s.ring_overflow)
        self.to_cm = None
        if s.report_address is not None:
            self.to_cm = PushSocket(self.ctx, s.report_address, bind=False)
        self.poller = zmq.Poller()
        self.poller.register(self.requests.socket, zmq.POLLIN)
        self.poller.register(self.steps.socket, zmq.POLLIN)

    def wait_for_workers(self) -> None:
        ready, deadline = {}, time.monotonic() + self.spec.config.startup_timeout_s
        while len(ready) < self.spec.config.tp:
            if self.life.should_stop() or time.monotonic() > deadline:
                raise TimeoutError(f"{len(ready)} of {self.spec.config.tp} workers ready")
            try:
                msg = self.steps.get(timeout=0.2)
            except TimeoutError:
                continue
            if isinstance(msg, WorkerFailed):
                raise RuntimeError(f"worker {msg.rank} failed to start: {msg.message}")
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg.kv_endpoint
        self.pd = PDCoordinator(self, [ready[r] for r in range(self.spec.config.tp)])

    # -- the loop ------------------------------------------------------------
    def loop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.ready()
        while not self.life.should_stop():
            if self.heartbeat is not None:
                self.heartbeat.beat({"steps": self.num_steps, "tokens": self.num_tokens},
                                    holds_work=bool(self.in_flight or self.pd.awaiting
                                                    or self.scheduler.has_unfinished))
            if self.hooks is not None and self.hooks.consume("drop-cache") is not None:
                log.warning("drill: dropped %d cached blocks", self.kv.reset_prefix_cache())
            self._fill_pipeline()
            idle = not self.in_flight
            events = dict(self.poller.poll(timeout=200 if idle else 1000))
            if self.requests.socket in events:
                self._recv_requests()
            if self.steps.socket in events:
                self._collect()
            self.pd.poll(time.monotonic())
            self._maybe_report()

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if self.to_cm is None or now - self.last_report < self.spec.report_interval_s:
            return
        self.last_report = now
        inserted, evicted = self.kv.tree.pop_events()
        finished, self.finished_ids = self.finished_ids, []
        transfer_bytes, transfer_seconds = self.pd.pop_transfer_stats()
        waiting, running = self.scheduler.waiting, self.scheduler.running
        self.to_cm.put(TEReport(
            te_id=self.spec.te_id, num_waiting=len(waiting), num_running=len(running),
            load_tokens=sum(map(_remaining_tokens, waiting)) + sum(map(_remaining_tokens, running)),
            kv_usage=self.kv.usage, num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens, inserted=inserted, evicted=evicted,
            finished=finished, kv_transfer_bytes=transfer_bytes,
            kv_transfer_seconds=transfer_seconds))

    def _fill_pipeline(self) -> None:
        while len(self.in_flight) < self.depth:
            scheduled = self.scheduler.schedule()
            if scheduled.is_empty:
                return
            step_id = next(self.step_ids)
            batch = scheduled.to_step_batch(step_id, self.kv, self.released)
            self.pd.attach_transfers(batch)
            self.released = []
            self.ring.put(self.encoder.encode(batch), timeout=30)
            self.scheduler.on_dispatched(scheduled)
            self.in_flight.append((step_id, scheduled))

    def _recv_requests(self) -> None:
        for msg in self.requests.drain():
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, FinishRequest):
                self.finish(msg.request_id, msg.reason)
            elif isinstance(msg, PrefillOrder):
                self._add_prefill(msg)
            elif isinstance(msg, KVReady):
                self.pd.on_kv_ready(msg)
            elif isinstance(msg, KVAck):
                self.pd.on_kv_ack(msg)
            elif isinstance(msg, GetStats):
                self.to_client.put(EngineStats(forward_spans=list(self.forward_spans),
                                               num_preemptions=self.scheduler.num_preemptions))

    def _add(self, msg: AddRequest) -> None:
        stops = set(msg.sampling.stop_token_ids)
        if not msg.sampling.ignore_eos:
            stops.update(self.model_config.eos_token_ids)
        seq = Sequence(next(self.seq_ids), msg.prompt_token_ids, msg.sampling,
                       frozenset(stops), msg.salt)
        self.seqs[msg.request_id] = seq
        self.request_ids[seq.seq_id] = msg.request_id
        if msg.prefill_from is not None:
            self.pd.add_decode(seq, msg.request_id, msg)
        else:
            self.scheduler.add(seq)

    def _add_prefill(self, order: PrefillOrder) -> None:
        seq = self.pd.add_prefill(order, next(self.seq_ids))
        if seq is not None:
            self.seqs[order.request_id] = seq
            self.request_ids[seq.seq_id] = order.request_id
            self.scheduler.add(seq)

    def finish(self, request_id: str, reason: str) -> None:
        if self.pd.drop_decode(request_id):
            return
        seq = self.seqs.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, reason)
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        request_id = self.request_ids.pop(seq.seq_id)
        del self.seqs[request_id]
        if not seq.keep_kv:  # a prefill task ends on the decode TE, which reports it
            self.finished_ids.append(request_id)
        self.num_prompt_tokens += seq.num_prompt_tokens
        self.num_cached_tokens += seq.num_cached_tokens or 0
        if seq.is_known_to_workers:
            self.released.append(seq.seq_id)

    def _collect(self) -> None:
        for msg in self.steps.drain():
            if isinstance(msg, WorkerFailed):
                raise RuntimeError(f"worker {msg.rank} failed: {msg.message}")
            if isinstance(msg, StepDone):
                self._on_step_done(msg)
            elif isinstance(msg, KVSent):
                self.pd.on_kv_sent(msg)

    def _on_step_done(self, done: StepDone) -> None:
        step_id, scheduled = self.in_flight.popleft()
        self.num_steps += 1
        self.forward_spans.append((done.forward_start, done.forward_end))
        assert done.output.step_id == step_id, (done.output.step_id, step_id)
        items = []
        for seq in self.scheduler.on_sampled(scheduled, done.output.sampled):
            if not self.pd.on_first_token(seq):
                items.append(self.new_tokens(seq))
            if seq.is_finished:
                self.release(seq)
        if items:
            self.num_tokens += len(items)
            self.to_tokenizer.put(StepTokens(items=items))

    def new_tokens(self, seq: Sequence) -> NewTokens:
        num_known = seq.num_tokens - seq.num_pending_tokens
        token = seq.token_ids[num_known - 1]
        logprobs = None
        if seq.sampling.logprobs is not None:
            last = seq.logprobs[-1]
            logprobs = [(last.token_id, last.logprob, last.top or [])]
        return NewTokens(self.request_ids[seq.seq_id], [token], seq.finish_reason,
                         seq.num_cached_tokens or 0, logprobs)

    def close(self) -> None:
        for request_id in list(self.seqs):
            try:  # whoever listens may be gone already: never hang on the way out
                self.to_client.put(RequestFailed(request_id=request_id, error="engine_dead",
                                                 message="the TE is shutting down"), timeout=0.2)
            except TimeoutError:
                break
        if self.pd is not None:
            self.pd.close()
        if self.ring is not None:
            try:
                self.ring.put(self.encoder.encode(StepBatch(SHUTDOWN_STEP_ID, [])), timeout=1)
            except TimeoutError:
                pass
            self.ring.close()
            self.ring.unlink()
        for sock in ("requests", "steps", "to_tokenizer", "to_client", "to_cm", "heartbeat"):
            if getattr(self, sock, None) is not None:
                getattr(self, sock).close()
        self.ctx.term()
