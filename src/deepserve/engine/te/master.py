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
    master <──ToTier / FromTier──> the node's KV tier service (engine/tiers/; else a NoTierLink)

Pipeline: with async scheduling up to two steps are in flight, so while the
workers run step N the master has already built and sent N+1; synchronous
mode keeps one, and so does async while a light tenant may come
(Scheduler.may_see_light_tenant: its request then waits for one step, not two). PD policy lives in engine/pd/coordinator.py; this loop only
carries out the effects it returns (sends, streams, failures, releases).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from contextlib import ExitStack
from multiprocessing.connection import Connection

import msgspec
import zmq

from deepserve.actor import ActorLife
from deepserve.config import EngineConfig
from deepserve.engine.pd.coordinator import PDCoordinator
from deepserve.engine.pd.effects import Effects
from deepserve.engine.scheduler import SchedulerOutput
from deepserve.engine.sequence import Sequence
from deepserve.engine.step_core import StepCore, check_request
from deepserve.engine.te.specs import MasterSpec
from deepserve.engine.te.te_report import (NoReportLink, ReportLink, answers, build_report,
                                           new_tokens)
from deepserve.engine.tiers.channel import DECODE_PATH
from deepserve.engine.tiers.link import NoTierLink, TierLink
from deepserve.errors import InvalidRequestError
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.shm_ring import BroadcastRing
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.ipc.timeline import Timeline
from deepserve.messages.cache import CacheOpsDone
from deepserve.messages.engine import (RETRYABLE_ERRORS, AddRequest, EngineStats,
                                       FinishRequest, FromWorker, GetStats, NewTokens,
                                       RequestFailed, StepDone, StepTokens, ToMaster,
                                       WorkerFailed, WorkerReady)
from deepserve.messages.pd import (CancelOrder, FailRequest, KVAck, KVReady, KVSent,
                                   PrefillOrder, ToPeer, pd_address)
from deepserve.messages.step import CACHE_ONLY_STEP_ID, SHUTDOWN_STEP_ID, StepBatch
from deepserve.model.config import load_model_config

log = logging.getLogger(__name__)


def master_main(spec: MasterSpec, death_pipe: Connection, ready_pipe: Connection) -> None:
    life = ActorLife("master", death_pipe, component=f"{spec.te_id}/master")
    with ExitStack() as cleanup:  # on the way out: the master (if built), then life
        cleanup.callback(life.close)
        try:
            master = Master(spec, life)  # binds its sockets: a failure is reported too
            cleanup.callback(master.close)
            ready_pipe.send(("ready", None))
            master.wait_for_workers()
            life.ready()
            life.run(master.step, master.progress, master.holds_work)
        except Exception as e:
            log.exception("master failed")
            ready_pipe.send(("error", f"{type(e).__name__}: {e}"))
            raise SystemExit(1)


class Master:
    def __init__(self, spec: MasterSpec, life: ActorLife):
        self.spec, self.life, cfg = spec, life, spec.config
        self.model_config = model_config = load_model_config(cfg.model, cfg.dtype)
        self.core = StepCore(cfg, model_config.eos_token_ids, model_config.vocab_size,
                             record_events=spec.report_address is not None,
                             collect_new_nodes=bool(spec.tier_address))
        self.block_bytes = model_config.kv_bytes_per_block(cfg.block_size, cfg.tp)
        self.kv, self.scheduler = self.core.kv, self.core.scheduler
        self.depth = 2 if cfg.async_scheduling else 1
        # (step id, what it scheduled, the seq ids it samples), oldest first
        self.in_flight: deque[tuple[int, SchedulerOutput, frozenset[int]]] = deque()
        self.forward_spans: deque[tuple[float, float]] = deque(maxlen=100_000)
        self.encoder = msgspec.msgpack.Encoder()
        self.staging: dict[int, tuple[str, str]] = {}  # decode seq -> (request id, prefill TE)
        self.read_paths: Counter[str] = Counter()  # DualPath's choices for the tasks taken
        self.num_steps = self.num_tokens = 0
        self.timeline = Timeline(f"{spec.te_id}/master", spec.config.timeline_dir)
        now = time.monotonic
        self.handlers = {  # message type -> its handler, whichever inbox it came in
            AddRequest: self._add, GetStats: self._send_stats,
            FinishRequest: lambda m: self.finish(m.request_id, m.reason),
            PrefillOrder: self._add_prefill,
            KVReady: self._on_kv_ready,
            KVAck: lambda m: self._apply(self.pd.on_kv_ack(m)),
            CancelOrder: lambda m: self._apply(self.pd.on_cancel(m, now())),
            StepDone: self._on_step_done, WorkerFailed: self._worker_failed,
            WorkerReady: lambda m: None,  # a restarted worker's late hello: nothing to do
            KVSent: lambda m: self._apply(self.pd.on_kv_sent(m, now())),
            CacheOpsDone: lambda m: self.tier.on_ops_done(m)}
        with ExitStack() as opened:  # a failure halfway closes what was opened
            self.ctx = zmq.Context()
            opened.callback(self.ctx.term)  # last: every socket is closed by then
            self._open(opened, cfg)
            self._resources = opened.pop_all()  # close() releases them, in reverse order

    def _open(self, opened: ExitStack, cfg: EngineConfig) -> None:
        """Sockets, links (do-nothing ones when absent), the PD policy, the ring."""
        s, ctx, keep = self.spec, self.ctx, opened.callback
        self.requests = PullSocket(ctx, s.requests_address, bind=True, type=ToMaster)
        keep(self.requests.close)
        self.from_peers = PullSocket(ctx, s.pd_address, bind=True, type=ToPeer)
        keep(self.from_peers.close)
        self.steps = PullSocket(ctx, s.steps_address, bind=True, type=FromWorker)
        keep(self.steps.close)
        self.to_tokenizer = PushSocket(ctx, s.tokenizer_address, bind=False)
        keep(self.to_tokenizer.close)
        self.to_client = PushSocket(ctx, s.client_address, bind=False)
        keep(self.to_client.close)
        self.peers = Outboxes(ctx)
        keep(self.peers.close)
        self.to_cm = (NoReportLink() if s.report_address is None
                      else ReportLink(ctx, s.report_address, s.report_interval_s))
        keep(self.to_cm.close)
        self.tier = (TierLink.of_master(ctx, s, self.kv, self.model_config, self.block_bytes,
                                        self.core.new_seq_id, self.life.event)
                     if s.tier_address and cfg.enable_prefix_caching
                     else NoTierLink(self.scheduler.add))
        keep(self.tier.close)
        self.poller = zmq.Poller()
        for sock in (self.requests, self.from_peers, self.steps):
            self.poller.register(sock.socket, zmq.POLLIN)
        self.tier.register(self.poller)
        self.pd = PDCoordinator(  # its KV endpoints come with the workers (wait_for_workers)
            self.kv, self.scheduler, te_id=s.te_id, tp=cfg.tp,
            max_model_len=cfg.max_model_len, kv_transfer_timeout_s=cfg.kv_transfer_timeout_s,
            address=s.pd_address, endpoints=[], layerwise=cfg.kv_transfer_layerwise,
            first_order_id=time.time_ns(), enqueue=self.tier.admit)  # a prompt may be below
        self.ring = BroadcastRing.create(s.ring_name, num_readers=cfg.tp,
                                         overflow_address=s.ring_overflow)
        keep(self.ring.unlink)  # after close: only the creator unlinks
        keep(self.ring.close)

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
        self.pd.endpoints = [ready[r] for r in range(cfg.tp)]  # where peers write our KV

    # -- the loop ------------------------------------------------------------
    def progress(self) -> dict[str, int]:
        return {"steps": self.num_steps, "tokens": self.num_tokens, "tier": self.tier.num_events}

    def holds_work(self) -> bool:
        # Not work here: tier waits (own deadlines; a bucket may outlast the progress
        # deadline), a step in flight (its workers hold it, beating per layer).
        return not self.in_flight and (self.pd.has_work or self.scheduler.has_unfinished)

    def step(self) -> None:
        """Fill the pipeline, wait (bounded) for anything, handle it, deadlines."""
        if self.life.faults.consume("drop-cache") is not None:
            log.warning("drill: dropped %d cached blocks", self.kv.reset_prefix_cache())
        self._fill_pipeline()
        events = dict(self.poller.poll(timeout=1000 if self.in_flight else 200))
        for inbox in (self.requests, self.from_peers, self.steps):
            if inbox.socket in events:
                for msg in inbox.drain():  # each inbox decodes only its channel's types
                    self.handlers[type(msg)](msg)
        self._apply(self.pd.poll(time.monotonic()))
        if self.tier.socket in events:
            self.tier.recv()
        self.tier.tick()
        self._take_tiers()
        self._maybe_report()

    def _fill_pipeline(self) -> None:
        depth = 1 if self.scheduler.may_see_light_tenant() else self.depth
        while len(self.in_flight) < depth:
            t0 = time.monotonic()
            step = self.core.schedule()
            if step is None:
                break
            scheduled, batch = step
            self.pd.attach_transfers(batch)
            batch.cache_ops = self.tier.take_ops()
            t1 = time.monotonic()
            self.ring.put(self.encoder.encode(batch), timeout=30)
            self.timeline.add("schedule", batch.step_id, t0, t1, len(batch.seqs))
            self.timeline.add("ring_write", batch.step_id, t1, time.monotonic())
            self.scheduler.on_dispatched(scheduled)
            self.in_flight.append((batch.step_id, scheduled,
                                   frozenset(s.seq_id for s in batch.seqs if s.do_sample)))
        if self.tier.pending_ops:  # nothing to run: ops alone
            ops = StepBatch(CACHE_ONLY_STEP_ID, [], cache_ops=self.tier.take_ops())
            self.ring.put(self.encoder.encode(ops), timeout=30)

    def _send_stats(self, _: GetStats) -> None:
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
            self.to_tokenizer.put(FailRequest(request_id=msg.request_id, message=str(e),
                                              error=getattr(e, "code", "invalid_request")))
            return
        if msg.request_id in self.core.seqs:
            log.warning("request id %r is live here already: the older one ends",
                        msg.request_id)
            self.finish(msg.request_id, "abort")
        is_decode_task = msg.prefill_from is not None and msg.sampling.prompt_logprobs is None
        seq = self.core.add(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.salt,
                            schedule=False)  # the tier link admits it (or the PD policy)
        seq.tenant, seq.tenant_weight = msg.tenant, msg.tenant_weight
        if msg.pin_context is not None and self.tier.can_pin_contexts:
            seq.pin_context, seq.keep_kv = msg.pin_context, True  # freed once pinned
        if is_decode_task:  # the JE names the prefill TE by its inbox
            prefill_from = pd_address(msg.prefill_from)
            if msg.read_path is not None:  # DualPath chose the side that reads storage
                self.read_paths[msg.read_path] += 1
            if msg.read_path == DECODE_PATH:  # DualPath: read here (no tiers: staged at once)
                self.staging[seq.seq_id] = (msg.request_id, prefill_from)
                self.tier.stage(seq, prefill_from)
            else:
                self._apply(self.pd.add_decode(msg.request_id, seq, prefill_from,
                                               time.monotonic()))
        else:  # sched-enqueue: its prefix may be below the device
            self.tier.admit(seq)
        self._take_tiers()

    def _take_tiers(self) -> None:
        """Queue what the tiers made ready, order the prefill of the decode
        tasks they staged, end (or fail) the contexts they pinned."""
        ready, staged, ended, failed = self.tier.take()
        for seq in ready:
            if not seq.is_finished:
                self.scheduler.add(seq)
        for seq in staged:
            request_id, prefill_from = self.staging.pop(seq.seq_id)
            if not seq.is_finished:
                self._apply(self.pd.add_decode(request_id, seq, prefill_from, time.monotonic()))
        for seq, error, why in [(s, None, "") for s in ended] + failed:
            request_id = self.core.request_ids.get(seq.seq_id)  # None: aborted meanwhile
            if request_id is not None and error is None:
                self._stream([new_tokens(self.core.request_ids[seq.seq_id], seq)])
            elif request_id is not None:
                self.to_tokenizer.put(FailRequest(request_id=request_id, error=error,
                                                  message=why))
            self._drop_kept(seq)
            self.core.release(seq)

    def _drop_kept(self, seq: Sequence | None) -> None:  # a context's KV, kept until pinned
        if seq is not None and seq.pin_context is not None and self.kv.has_seq(seq.seq_id):
            self.kv.free(seq.seq_id)

    def _add_prefill(self, order: PrefillOrder) -> None:
        try:  # what the tokenizer checks for our own requests
            check_request(order.prompt_token_ids, order.sampling, self.core.vocab_size,
                          self.spec.config.max_model_len)
        except InvalidRequestError as e:  # e.g. a prompt past this TE's max_model_len
            self.peers.put(order.reply_to, KVReady(
                request_id=order.request_id, order_id=order.order_id, error=str(e),
                is_retryable=False, code=e.code))
            return
        self._apply(self.pd.add_prefill(order, self.core.new_seq_id()))

    def _on_kv_ready(self, msg: KVReady) -> None:
        seq = self.core.seqs.get(msg.request_id)
        if seq is not None:  # its prefill TE is done with what we staged for it
            self.tier.unstage(seq.seq_id)
        self._apply(self.pd.on_kv_ready(msg))

    def finish(self, request_id: str, reason: str) -> None:
        seq = self.core.seqs.get(request_id)
        if seq is not None:
            self.tier.unstage(seq.seq_id)
        effects = self.pd.drop_decode(request_id, time.monotonic())
        if effects is not None:
            self._apply(effects)
        else:
            self._drop_kept(self.core.finish(request_id, reason))

    def _apply(self, effects: Effects) -> None:
        """Carry out what the PD policy decided, in the order Effects documents."""
        if not effects:
            return
        for address, msg in effects.sends:
            self.peers.put(address, msg)
        for request_id, seq in effects.started:  # prefill tasks: not our requests
            self.core.track(request_id, seq, is_request=False)
        if effects.emit:
            ids = self.core.request_ids
            self._stream([new_tokens(ids[seq.seq_id], seq) for seq in effects.emit])
        for msg in effects.failed:
            self.to_tokenizer.put(msg)
        for seq in effects.released:
            self.core.release(seq)

    @staticmethod
    def _worker_failed(msg: WorkerFailed) -> None:
        raise RuntimeError(f"worker {msg.rank} failed: {msg.message}")

    def _on_step_done(self, done: StepDone) -> None:
        if not self.in_flight or not answers(done, *self.in_flight[0]):
            log.warning("StepDone for step %d does not answer the oldest step in flight "
                        "(%s): dropped", done.output.step_id,
                        self.in_flight[0][0] if self.in_flight else "none")
            return
        step_id, scheduled, _ = self.in_flight.popleft()
        t_collect = time.monotonic()
        self.num_steps += 1
        self.forward_spans.append((done.forward_start, done.forward_end))
        items, now = [], time.monotonic()
        self.tier.observe_step(scheduled.scheduled.values(), done.forward_end - done.forward_start)
        for lost in done.output.lost_loads:  # computed without its KV: fails, uncommitted
            self.tier.lost_layers(lost.corrupt)
            self._fail_seq(scheduled.seqs.get(lost.seq_id), lost.message, "kv_transfer_failed")
        for seq in self.scheduler.on_sampled(scheduled, done.output.sampled):
            if self.pd.is_prefill(seq):  # its token goes to the decode TE in KVReady
                self._apply(self.pd.on_first_token(seq, now))
            elif seq.pin_context is not None and seq.is_finished:
                self.tier.pin_context(seq, self.kv.nodes_of(seq.seq_id))  # streams once pinned
                continue
            else:
                items.append(new_tokens(self.core.request_ids[seq.seq_id], seq))
            if seq.is_finished:
                self.core.release(seq)
        self._stream(items, step_id)
        for failure in done.output.failed:
            self._fail_seq(scheduled.seqs.get(failure.seq_id), failure.message)
        self.timeline.add("collect", step_id, t_collect, time.monotonic(), len(items))

    def _fail_seq(self, seq: Sequence | None, message: str, error: str = "request_failed"
                  ) -> None:
        """A worker failed one sequence: that request fails (its caller hears
        why; a RETRYABLE_ERRORS error is resubmitted), the batch and the TE go on."""
        if seq is None or seq.is_finished:
            return  # finished (aborted, stopped) while the step ran
        log.warning("request of seq %d failed in a worker: %s", seq.seq_id, message)
        if self.pd.is_prefill(seq):  # the decode TE hears it in KVReady
            self._apply(self.pd.on_prefill_failed(seq, message, error in RETRYABLE_ERRORS))
            return
        request_id = self.core.fail(seq)
        self._drop_kept(seq)
        if request_id is not None:
            self.to_tokenizer.put(FailRequest(request_id=request_id, error=error,
                                              message=f"the request failed: {message}"))

    def _stream(self, items: list[NewTokens], step_id: int = -1) -> None:
        if items:
            self.num_tokens += len(items)
            self.to_tokenizer.put(StepTokens(items=items, step_id=step_id))

    def _maybe_report(self) -> None:
        self.to_cm.maybe_send(time.monotonic(), lambda: build_report(
            self.spec.te_id, self.core, self.pd, self.tier, self.spec.config.tp * self.block_bytes,
            read_paths=dict(self.read_paths)))

    def close(self) -> None:
        self.timeline.close()
        for request_id in list(self.core.seqs):
            try:  # whoever listens may be gone already: never hang on the way out
                self.to_client.put(RequestFailed(request_id=request_id, error="engine_dead",
                                                 message="the TE is shutting down"), timeout=0.2)
            except TimeoutError:
                break
        try:
            self.ring.put(self.encoder.encode(StepBatch(SHUTDOWN_STEP_ID, [])), timeout=1)
        except TimeoutError:
            pass
        self._resources.close()  # the ring (closed, unlinked), the sockets, the context
