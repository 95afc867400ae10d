"""One device worker process of a TE (SPMD: every rank runs this program).

    master ══ StepBatch (shared-memory broadcast ring) ══> worker r (reader r)
    worker 0 ──StepDone (PUSH)──> master      every rank: WorkerReady / WorkerFailed
    ranks <── torch.distributed (gloo on CPU) ──> ranks      two all-reduces a layer
    worker r ══ DistFlow (KVTransferOrder of a step) ══> rank r of a decode TE
    worker r ──KVSent──> master
    StepBatch.cache_ops ──> cache executor thread (cache_executor.py) ──CacheOpsDone──> master
                            layered loads: finished inside their sequence's forward (layer_loads.py)

The worker holds work from the moment it takes a StepBatch off the ring
until it has put that step's StepDone; its progress counters are steps
completed and layers computed (it beats between layers too, so a step may
last longer than the deadlines). The stall drill stops it inside a step,
where it keeps beating with that real holds_work, so the supervisor's
ordinary rule finds it hung.

The KV pool lives in a named shared-memory segment (owner-only, unlinked on
every exit path by this process, its creator; the launcher sweeps the run's
names once more if the process was killed). Sampled ids stay here: a step's
PLACEHOLDER inputs are the ids this worker sampled in its previous step.

Errors: per-request or fatal. A request's own error — a value its sampling
cannot take, a shape error in its sampling state (model_runner's
is_request_error: a plain Python or shape error raised while setting up or
sampling that request's row) — fails that request alone: the StepDone
carries it in StepOutput.failed, the master answers the caller with
RequestFailed("request_failed") and the step's other requests go on. Fatal,
the worker reports WorkerFailed and exits (the TE is restarted): any error in
the forward (it writes every sequence's KV, so the pool may be half-written),
in a KV transfer's bookkeeping, in the ring or sockets, out of memory (host
or device), anything naming CUDA / NCCL / gloo or a collective (the device
or the process group is suspect), and anything that is not an Exception.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch
import zmq

from deepserve.actor import ActorLife
from deepserve.cache.weight_cache import cached_model_dir
from deepserve.config import EngineConfig
from deepserve.errors import ModelLoadError
from deepserve.ipc.segments import create_segment, segment_name, unlink_segment
from deepserve.ipc.shm_ring import BroadcastRing, RingNotReady
from deepserve.ipc.timeline import Timeline
from deepserve.ipc.sockets import PushSocket
from deepserve.messages.engine import StepDone, WorkerFailed, WorkerReady
from deepserve.worker.cache_executor import CacheExecutor
from deepserve.worker.kv_sender import KVSender
from deepserve.messages.step import CACHE_ONLY_STEP_ID, SHUTDOWN_STEP_ID, StepBatch
from deepserve.model import kernels
from deepserve.model.decoder import CausalLM
from deepserve.model.loader import load_model
from deepserve.model.parallel import TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from deepserve.structured.matchers import GrammarBook
from deepserve.transfer.receiver import kv_bind
from deepserve.worker.model_runner import ModelRunner
from deepserve.worker.spec import WorkerSpec

log = logging.getLogger(__name__)


def worker_main(spec: WorkerSpec, death_pipe: Connection, ready_pipe: Connection) -> None:
    life = ActorLife(f"worker{spec.rank}", death_pipe,
                     component=f"{spec.te_id}/worker{spec.rank}")
    torch.set_num_threads(spec.config.num_threads
                          or max(1, (os.cpu_count() or 1) // spec.config.tp))
    kernels.start_flushing_denormals()  # before any other parallel op
    worker = _Worker(spec, life)
    try:
        worker.start()
        ready_pipe.send(("ready", worker.ready_detail()))
        life.ready()
        life.run(worker.step, worker.progress, worker.holds_work)
    except Exception as e:  # report, then exit non-zero: the TE fails loudly
        log.error("worker %d failed: %s", spec.rank, traceback.format_exc())
        worker.report_failure(f"{type(e).__name__}: {e}")
        ready_pipe.send(("error", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        worker.close()
        life.close()


class _Worker:
    cache_exec = None  # a CacheExecutor once started (tests build workers without one)
    timeline = Timeline("worker")  # off; __init__ sets the TE's (tests build workers without)

    def __init__(self, spec: WorkerSpec, life: ActorLife):
        self.spec, self.life = spec, life
        self.tp = TensorParallel(spec.rank, spec.config.tp)
        self.ctx = zmq.Context()
        self.kv_name = segment_name(spec.run_id, f"kv-r{spec.rank}")
        self.kv_segment = self.runner = self.ring = self.out = self.kv_sender = None
        self.decoder = msgspec.msgpack.Decoder(StepBatch)
        self.num_steps = 0  # steps completed: the progress counter
        self.num_layers = 0  # layers computed, a step's own progress (see _layer_done)
        self.num_grammar_waits = 0  # beats while the grammar engine started (progress)
        self.in_step = False  # a batch taken off the ring, its StepDone not yet put
        self.weights, self.load_s = "disk", 0.0  # where the weights came from, how long
        self.timeline = Timeline(f"{spec.te_id}/worker{spec.rank}", spec.config.timeline_dir)

    def start(self) -> None:
        cfg = self.spec.config
        self.out = PushSocket(self.ctx, self.spec.step_done_address, bind=False)
        if self.tp.is_parallel:
            init_tensor_parallel(self.tp.rank, self.tp.size, self.spec.dist_init_method)
        model = self._load_model()
        shape = ModelRunner.kv_pool_shape(model, cfg.num_kv_blocks, cfg.block_size)
        nbytes = model.config.dtype.itemsize * int(torch.Size(shape).numel())
        self.kv_segment = create_segment(self.kv_name, nbytes)
        pool = torch.frombuffer(self.kv_segment.buf, dtype=model.config.dtype).view(shape)
        self.attach_runner(ModelRunner(model, cfg.num_kv_blocks, cfg.block_size, cfg.seed, pool))
        self.runner.grammars = GrammarBook(cfg.model, model.config.vocab_size,
                                           model.config.eos_token_ids)
        self.runner.grammars.beat = self._grammar_wait
        self.ring = self._attach_ring(time.monotonic() + cfg.startup_timeout_s)
        run_dir, rank = self.spec.run_dir, self.tp.rank
        self.kv_sender = KVSender(pool, self.kv_name, rank, cfg, self.ctx, self.life.faults,
                                  bind=kv_bind(cfg.kv_bind_host, run_dir, f"kv-recv{rank}"))
        stream = (kv_bind(cfg.kv_bind_host, run_dir, f"kv-stream{rank}"), cfg.kv_stream_bytes,
                  2 * cfg.kv_transfer_timeout_s) if cfg.kv_stream_bytes else None
        self.cache_exec = CacheExecutor(pool, rank, self.tp.size, self.ctx,
                                        self.spec.step_done_address, cfg.storage_read_gbps,
                                        stream=stream)
        self.runner.layer_loads = self.cache_exec.layers  # consumed by their seq's forward
        self.cache_exec.layers.beat = lambda: self.life.beat(self.progress(), self.in_step)
        self.out.put(WorkerReady(rank=self.tp.rank, pid=os.getpid(),
                                 kv_endpoint=self.kv_sender.endpoint))

    def _load_model(self) -> CausalLM:
        """This rank's weights from the node's weight cache when it holds the
        model, else from the model dir (also when the entry was evicted before
        we opened its files)."""
        cfg = self.spec.config
        start = time.perf_counter()
        weights_dir, self.weights = cached_model_dir(cfg.model, self.spec.weight_cache)
        try:
            model = load_model(weights_dir, cfg.dtype, tp=self.tp, quantize=cfg.quantize)
        except (OSError, ModelLoadError) as e:
            if self.weights != "cache":
                raise
            log.warning("weight cache %s unusable (%s): loading from disk", weights_dir, e)
            self.weights = "disk"
            model = load_model(cfg.model, cfg.dtype, tp=self.tp, quantize=cfg.quantize)
        self.load_s = time.perf_counter() - start
        return model

    def ready_detail(self) -> dict:
        """What the launcher keeps of this worker's start (TE stage timings)."""
        return {"weights": self.weights, "load_s": self.load_s, "rank": self.tp.rank,
                "pid": os.getpid()}

    def _attach_ring(self, deadline: float) -> BroadcastRing:
        """The master creates the ring; it may not exist yet when we get here,
        or exist without its header (the master is between creating and
        filling it in)."""
        while True:
            try:
                return BroadcastRing.attach(self.spec.ring_name, self.spec.rank,
                                            overflow_address=self.spec.ring_overflow)
            except (FileNotFoundError, RingNotReady):
                if time.monotonic() > deadline or self.life.should_stop():
                    raise
                time.sleep(0.05)

    # -- the loop (ActorLife.run beats between steps) ---------------------------
    def progress(self) -> dict[str, int]:
        waits = self.cache_exec.layers.num_waits if self.cache_exec is not None else 0
        return {"steps": self.num_steps, "layers": self.num_layers, "layer_waits": waits,
                "grammar_waits": self.num_grammar_waits}

    def attach_runner(self, runner) -> None:
        self.runner = runner
        runner.on_layer = self._layer_done
        runner.timeline = self.timeline

    def _grammar_wait(self) -> None:
        """While the grammar engine starts (structured/compile.while_beating)."""
        self.num_grammar_waits += 1
        self.life.beat(self.progress(), self.in_step)

    def _layer_done(self, i: int) -> None:
        """Inside a step, after each layer: a beat when one is due (the sender
        rate-limits), so a long step of a big model (a 2k-token prefill can
        take longer than heartbeat_deadline_s) is alive and progressing, and
        only a layer that never ends reads as silence."""
        self.num_layers += 1
        self.life.beat(self.progress(), self.in_step)

    def holds_work(self) -> bool:
        return self.in_step

    def step(self) -> bool:
        """One batch off the ring (or a 0.2 s wait); False on the shutdown batch."""
        self.life.faults.active("poison")  # idle too: armed (its firing reported) before
        # a batch brings the marker, so the fault_injected event is not lost in the exit
        if self.cache_exec is not None:  # drill: die mid-way through staging KV for a PE
            self.cache_exec.die_in_stage = self.life.faults.active("stage-die") is not None
        t_wait = time.monotonic()
        try:
            data = self.ring.get(timeout=0.2)
        except TimeoutError:
            return True
        t_got = time.monotonic()
        batch = self.decoder.decode(data)
        if self.timeline.on:
            self.timeline.add("ring_wait", batch.step_id, t_wait, t_got)
            self.timeline.add("ring_read", batch.step_id, t_got, time.monotonic())
        if batch.step_id == SHUTDOWN_STEP_ID:
            return False
        if batch.cache_ops:  # copies of committed or holder-owned blocks: never wait
            self.cache_exec.submit(batch.cache_ops)
        if batch.step_id == CACHE_ONLY_STEP_ID:
            return True
        self.in_step = True
        self._drill_bad_sampling(batch)
        self._drill_poison(batch)
        start = time.monotonic()
        if batch.transfers:
            output, sent = self.kv_sender.execute(self.runner, batch)
            for msg in sent:
                self.out.put(msg)
        else:
            output = self.runner.execute(batch)
        end = time.monotonic()
        self._drill_faults()
        if self.tp.rank == 0:
            self.out.put(StepDone(output=output, forward_start=start, forward_end=end))
            self.timeline.add("step_done", batch.step_id, end, time.monotonic())
        self.in_step = False
        self.num_steps += 1
        return True

    def _drill_faults(self) -> None:
        """Drill-only, inside a step: stalled (alive, beating with the real
        holds_work, no progress) or slow."""
        faults = self.life.faults
        while faults.active("stall") is not None and not self.life.should_stop():
            self.life.beat(self.progress(), self.holds_work())
            time.sleep(0.05)
        delay = faults.active("slow")
        if delay:  # "" (an empty file) is no delay
            time.sleep(float(delay))

    def _drill_bad_sampling(self, batch: StepBatch) -> None:
        """Drill-only: a request's own bad value. A new sequence seeded with the
        hook file's number gets a top_k the sampler cannot compare, so sampling
        it raises TypeError: a per-request error (model_runner), not a crash."""
        value = self.life.faults.active("bad-sampling")
        if not value:
            return
        for new in batch.new_seqs:
            if str(new.sampling.seed) == value:
                new.sampling = msgspec.structs.replace(new.sampling, top_k="bad")

    def _drill_poison(self, batch: StepBatch) -> None:
        """Drill-only: die as a segfault would (no report, no cleanup, exit 13)
        when a sequence's new tokens in this step contain the marker, the
        hook file's comma-separated token ids (a request of death)."""
        value = self.life.faults.active("poison")
        if not value:
            return
        try:
            marker = [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            return  # not token ids: a drill's mistake must not crash the worker
        if any(_contains(seq.token_ids, marker) for seq in batch.seqs):
            log.error("drill: poison marker %s in step %d: exit 13", marker, batch.step_id)
            os._exit(13)

    def report_failure(self, message: str) -> None:
        if self.out is not None:
            self.out.put(WorkerFailed(rank=self.tp.rank, message=message))

    def close(self) -> None:
        """Release in reverse order; the pool's tensors must die before its segment."""
        if self.cache_exec is not None:
            self.cache_exec.close()
            self.cache_exec = None
        self.timeline.close()
        self.runner = None
        if self.kv_sender is not None:
            self.kv_sender.close()
            self.kv_sender = None
        gc.collect()
        if self.ring is not None:
            self.ring.close()
        if self.kv_segment is not None:
            try:
                self.kv_segment.close()
            finally:
                unlink_segment(self.kv_name)
        if self.out is not None:
            self.out.close()
        self.ctx.term()
        if self.tp.is_parallel:
            destroy_tensor_parallel()


def _contains(tokens: list[int], marker: list[int]) -> bool:
    """`marker` is a contiguous run in `tokens` (an empty marker never is)."""
    n = len(marker)
    return n > 0 and any(tokens[i:i + n] == marker for i in range(len(tokens) - n + 1))
