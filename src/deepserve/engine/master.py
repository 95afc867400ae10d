"""The TE master: scheduler and RTC control, one step ahead of the workers.

    tokenizer ──AddRequest/FinishRequest/GetStats──> [requests PULL]
    other TEs' masters ──PrefillOrder/KVReady/KVAck/CancelOrder──> [pd PULL] (messages/pd.py)
                                                  │
                StepCore (Scheduler + KVCacheManager) · PDCoordinator (effects)
                                                  │ StepBatch, encoded once
                                   shared-memory broadcast ring ══> workers
    workers ──StepDone/WorkerReady/WorkerFailed/KVSent──> [steps PULL]
    master ──StepTokens/FailRequest──> tokenizer (detokenizes, streams to the client)
    master ──PD messages──> peers' [pd PULL];  TEReport ──> cluster manager
    master ──RequestFailed──> client (on the way out)

Pipeline: with async scheduling up to two steps are in flight, so while the
workers run step N the master has already built and sent N+1; synchronous
mode keeps one. PD policy lives in engine/pd.py; this loop only carries out
the effects it returns (sends, streams, failures, releases).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from deepserve.actor import ActorLife
from deepserve.config import EngineConfig
from deepserve.engine.pd import Effects, PDCoordinator
from deepserve.engine.scheduler import SchedulerOutput
from deepserve.engine.sequence import Sequence
from deepserve.engine.step_core import StepCore, check_request
from deepserve.errors import InvalidRequestError
from deepserve.ipc.shm_ring import BroadcastRing
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.messages.control import TEReport
from deepserve.messages.engine import (AddRequest, EngineStats, FinishRequest, FromWorker,
                                       GetStats, NewTokens, RequestFailed, StepDone,
                                       StepTokens, ToMaster, WorkerFailed, WorkerReady)
from deepserve.messages.pd import (CancelOrder, FailRequest, KVAck, KVReady, KVSent,
                                   PrefillOrder, ToPeer, pd_address)
from deepserve.messages.step import SHUTDOWN_STEP_ID, StepBatch
from deepserve.model.config import load_model_config

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
    pd_address: str  # peers' masters reach this one here: pd_address(the TE's inbox)
    te_id: str = "te"
    report_address: str | None = None  # the cluster manager's inbox, if any
    report_interval_s: float = 0.5


def master_main(spec: MasterSpec, death_pipe: Connection, ready_pipe: Connection) -> None:
    life = ActorLife("master", death_pipe, component=f"{spec.te_id}/master")
    master = Master(spec, life)
    try:
        master.start()
        ready_pipe.send(("ready", None))
        master.wait_for_workers()
        life.ready()
        life.run(master.step, master.progress, master.holds_work)
    except Exception as e:
        log.exception("master failed")
        ready_pipe.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1)
    finally:
        master.close()
        life.close()


def _answers(done: StepDone, step_id: int, scheduled: SchedulerOutput,
             sampling_ids: frozenset[int]) -> bool:
    """Is `done` rank 0's answer to this step? Its id, and one token or one
    failure for each sequence the step samples, except sequences finished
    already (a seq failed earlier is not reported again)."""
    out = done.output
    if out.step_id != step_id:
        return False
    answered = [t.seq_id for t in out.sampled] + [f.seq_id for f in out.failed]
    if len(set(answered)) != len(answered) or not set(answered) <= sampling_ids:
        return False
    return all(scheduled.seqs[i].is_finished for i in sampling_ids.difference(answered))


def _remaining_tokens(seq: Sequence) -> int:
    """Load a sequence still puts on the TE: tokens to compute + tokens to generate."""
    return (seq.num_uncomputed_tokens
            + max(0, seq.sampling.max_tokens - seq.num_output_tokens))


class Master:
    def __init__(self, spec: MasterSpec, life: ActorLife):
        self.spec, self.life, cfg = spec, life, spec.config
        model_config = load_model_config(cfg.model, cfg.dtype)
        self.core = StepCore(cfg, model_config.eos_token_ids, model_config.vocab_size,
                             record_events=spec.report_address is not None)
        self.kv, self.scheduler = self.core.kv, self.core.scheduler
        self.depth = 2 if cfg.async_scheduling else 1
        # (step id, what it scheduled, the seq ids it samples), oldest first
        self.in_flight: deque[tuple[int, SchedulerOutput, frozenset[int]]] = deque()
        self.forward_spans: deque[tuple[float, float]] = deque(maxlen=100_000)
        self.last_report = 0.0
        self.ctx = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self.ring = self.pd = self.to_cm = None
        self.num_steps = self.num_tokens = 0

    def start(self) -> None:
        s = self.spec
        self.requests = PullSocket(self.ctx, s.requests_address, bind=True, type=ToMaster)
        self.from_peers = PullSocket(self.ctx, s.pd_address, bind=True, type=ToPeer)
        self.steps = PullSocket(self.ctx, s.steps_address, bind=True, type=FromWorker)
        self.to_tokenizer = PushSocket(self.ctx, s.tokenizer_address, bind=False)
        self.to_client = PushSocket(self.ctx, s.client_address, bind=False)
        self.peers = Outboxes(self.ctx)
        self.ring = BroadcastRing.create(s.ring_name, num_readers=s.config.tp,
                                         overflow_address=s.ring_overflow)
        if s.report_address is not None:
            self.to_cm = PushSocket(self.ctx, s.report_address, bind=False)
        self.poller = zmq.Poller()
        for sock in (self.requests, self.from_peers, self.steps):
            self.poller.register(sock.socket, zmq.POLLIN)

    def wait_for_workers(self) -> None:
        cfg = self.spec.config
        ready, deadline = {}, time.monotonic() + cfg.startup_timeout_s
        while len(ready) < cfg.tp:
            if self.life.should_stop() or time.monotonic() > deadline:
                raise TimeoutError(f"{len(ready)} of {cfg.tp} workers ready")
            try:
                msg = self.steps.get(timeout=0.2)
            except TimeoutError:
                continue
            if isinstance(msg, WorkerFailed):
                raise RuntimeError(f"worker {msg.rank} failed to start: {msg.message}")
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg.kv_endpoint
        self.pd = PDCoordinator(
            self.kv, self.scheduler, te_id=self.spec.te_id, tp=cfg.tp,
            max_model_len=cfg.max_model_len, kv_transfer_timeout_s=cfg.kv_transfer_timeout_s,
            address=self.spec.pd_address, endpoints=[ready[r] for r in range(cfg.tp)],
            layerwise=cfg.kv_transfer_layerwise, first_order_id=time.time_ns())

    # -- the loop ------------------------------------------------------------
    def progress(self) -> dict[str, int]:
        return {"steps": self.num_steps, "tokens": self.num_tokens}

    def holds_work(self) -> bool:
        return bool(self.in_flight or self.pd.has_work or self.scheduler.has_unfinished)

    def step(self) -> None:
        """Fill the pipeline, wait (bounded) for anything, handle it, deadlines."""
        if self.life.faults.consume("drop-cache") is not None:
            log.warning("drill: dropped %d cached blocks", self.kv.reset_prefix_cache())
        self._fill_pipeline()
        events = dict(self.poller.poll(timeout=1000 if self.in_flight else 200))
        if self.requests.socket in events:
            self._recv_requests()
        if self.from_peers.socket in events:
            self._recv_peers()
        if self.steps.socket in events:
            self._collect()
        self._apply(self.pd.poll(time.monotonic()))
        self._maybe_report()

    def _fill_pipeline(self) -> None:
        while len(self.in_flight) < self.depth:
            step = self.core.schedule()
            if step is None:
                return
            scheduled, batch = step
            self.pd.attach_transfers(batch)
            self.ring.put(self.encoder.encode(batch), timeout=30)
            self.scheduler.on_dispatched(scheduled)
            self.in_flight.append((batch.step_id, scheduled,
                                   frozenset(s.seq_id for s in batch.seqs if s.do_sample)))

    def _recv_requests(self) -> None:
        for msg in self.requests.drain():
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, FinishRequest):
                self.finish(msg.request_id, msg.reason)
            elif isinstance(msg, GetStats):
                self.to_client.put(EngineStats(forward_spans=list(self.forward_spans),
                                               num_preemptions=self.scheduler.num_preemptions))

    def _add(self, msg: AddRequest) -> None:
        """The tokenizer checked the request; a forged or stale AddRequest is
        checked again here (a bad id would fail the workers' forward), and a
        request id still live here is an abandoned earlier request: it ends."""
        try:
            check_request(msg.prompt_token_ids, msg.sampling, self.core.vocab_size,
                          self.spec.config.max_model_len)
            if msg.prefill_from is not None:
                pd_address(msg.prefill_from)
        except (InvalidRequestError, ValueError) as e:
            log.warning("AddRequest %r refused: %s", msg.request_id, e)
            self.to_tokenizer.put(FailRequest(request_id=msg.request_id,
                                              error="invalid_request", message=str(e)))
            return
        if msg.request_id in self.core.seqs:
            log.warning("request id %r is live here already: the older one ends",
                        msg.request_id)
            self.finish(msg.request_id, "abort")
        is_decode_task = msg.prefill_from is not None
        seq = self.core.add(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.salt,
                            schedule=not is_decode_task)
        if is_decode_task:  # the JE names the prefill TE by its inbox
            self._apply(self.pd.add_decode(msg.request_id, seq, pd_address(msg.prefill_from),
                                           time.monotonic()))

    def _recv_peers(self) -> None:
        for msg in self.from_peers.drain():
            if isinstance(msg, PrefillOrder):
                self._add_prefill(msg)
            elif isinstance(msg, KVReady):
                self._apply(self.pd.on_kv_ready(msg))
            elif isinstance(msg, KVAck):
                self._apply(self.pd.on_kv_ack(msg))
            elif isinstance(msg, CancelOrder):
                self._apply(self.pd.on_cancel(msg, time.monotonic()))

    def _add_prefill(self, order: PrefillOrder) -> None:
        try:  # what the tokenizer checks for our own requests
            check_request(order.prompt_token_ids, order.sampling, self.core.vocab_size,
                          self.spec.config.max_model_len)
        except InvalidRequestError as e:
            self.peers.put(order.reply_to, KVReady(request_id=order.request_id,
                                                   order_id=order.order_id, error=str(e)))
            return
        self._apply(self.pd.add_prefill(order, self.core.new_seq_id()))

    def finish(self, request_id: str, reason: str) -> None:
        effects = self.pd.drop_decode(request_id, time.monotonic())
        if effects is not None:
            self._apply(effects)
        else:
            self.core.finish(request_id, reason)

    def _apply(self, effects: Effects) -> None:
        """Carry out what the PD policy decided, in the order Effects documents."""
        if not effects:
            return
        for address, msg in effects.sends:
            self.peers.put(address, msg)
        for request_id, seq in effects.started:  # prefill tasks: not our requests
            self.core.track(request_id, seq, is_request=False)
        if effects.emit:
            self._stream([self.new_tokens(seq) for seq in effects.emit])
        for msg in effects.failed:
            self.to_tokenizer.put(msg)
        for seq in effects.released:
            self.core.release(seq)

    def _collect(self) -> None:
        for msg in self.steps.drain():
            if isinstance(msg, WorkerFailed):
                raise RuntimeError(f"worker {msg.rank} failed: {msg.message}")
            if isinstance(msg, StepDone):
                self._on_step_done(msg)
            elif isinstance(msg, KVSent):
                self._apply(self.pd.on_kv_sent(msg, time.monotonic()))

    def _on_step_done(self, done: StepDone) -> None:
        if not self.in_flight or not _answers(done, *self.in_flight[0]):
            log.warning("StepDone for step %d does not answer the oldest step in flight "
                        "(%s): dropped", done.output.step_id,
                        self.in_flight[0][0] if self.in_flight else "none")
            return
        step_id, scheduled, _ = self.in_flight.popleft()
        self.num_steps += 1
        self.forward_spans.append((done.forward_start, done.forward_end))
        items, now = [], time.monotonic()
        for seq in self.scheduler.on_sampled(scheduled, done.output.sampled):
            if self.pd.is_prefill(seq):  # its token goes to the decode TE in KVReady
                self._apply(self.pd.on_first_token(seq, now))
            else:
                items.append(self.new_tokens(seq))
            if seq.is_finished:
                self.core.release(seq)
        self._stream(items)
        for failure in done.output.failed:
            self._fail_seq(scheduled.seqs.get(failure.seq_id), failure.message)

    def _fail_seq(self, seq: Sequence | None, message: str) -> None:
        """A worker failed one sequence for a reason of its own: that request
        fails (its caller hears why), the batch and the TE carry on."""
        if seq is None or seq.is_finished:
            return  # finished (aborted, stopped) while the step ran
        log.warning("request of seq %d failed in a worker: %s", seq.seq_id, message)
        if self.pd.is_prefill(seq):  # the decode TE hears it in KVReady
            self._apply(self.pd.on_prefill_failed(seq, message))
            return
        request_id = self.core.fail(seq)
        if request_id is not None:
            self.to_tokenizer.put(FailRequest(request_id=request_id, error="request_failed",
                                              message=f"the request failed: {message}"))

    def _stream(self, items: list[NewTokens]) -> None:
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
        return NewTokens(self.core.request_ids[seq.seq_id], [token], seq.finish_reason,
                         seq.num_cached_tokens or 0, logprobs)

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if self.to_cm is None or now - self.last_report < self.spec.report_interval_s:
            return
        self.last_report = now
        inserted, evicted = self.kv.tree.pop_events()
        transfer_bytes, transfer_seconds = self.pd.pop_transfer_stats()
        waiting, running = self.scheduler.waiting, self.scheduler.running
        self.to_cm.put(TEReport(
            te_id=self.spec.te_id, num_waiting=len(waiting), num_running=len(running),
            load_tokens=sum(map(_remaining_tokens, waiting)) + sum(map(_remaining_tokens, running)),
            kv_usage=self.kv.usage, num_prompt_tokens=self.core.num_prompt_tokens,
            num_cached_tokens=self.core.num_cached_tokens, inserted=inserted, evicted=evicted,
            finished=self.core.pop_finished(), kv_transfer_bytes=transfer_bytes,
            kv_transfer_seconds=transfer_seconds))

    def close(self) -> None:
        for request_id in list(self.core.seqs):
            try:  # whoever listens may be gone already: never hang on the way out
                self.to_client.put(RequestFailed(request_id=request_id, error="engine_dead",
                                                 message="the TE is shutting down"), timeout=0.2)
            except TimeoutError:
                break
        if self.ring is not None:
            try:
                self.ring.put(self.encoder.encode(StepBatch(SHUTDOWN_STEP_ID, [])), timeout=1)
            except TimeoutError:
                pass
            self.ring.close()
            self.ring.unlink()
        for sock in ("requests", "from_peers", "steps", "to_tokenizer", "to_client", "to_cm",
                     "peers"):
            if getattr(self, sock, None) is not None:
                getattr(self, sock).close()
        self.ctx.term()
