"""TELauncher: start one TE's processes, watch them, stop them.

    launcher (the caller's process)
    ├─ tokenizer      tokenizer_main   binds the TE's inbox
    ├─ master         master_main      binds pd_address(inbox) for peer masters
    └─ worker 0..tp-1 worker_main (SPMD)

Children are forked from a forkserver that preloaded torch and the actors'
modules (no shared state: it has done nothing but import). The launcher
itself imports no torch: it names each child's entry point by module and
function (_child_main imports it in the child), so a TE server or a
pre-warmed pod pays for one torch import, its forkserver's. Every child gets
a death pipe (it exits when this process dies) and a ready
pipe (it says "ready" or why not). The launcher notices dead children by
their sentinels. Everything of a run lives under names derived from its run
id: a short run directory for the ipc:// sockets and shared-memory segments
`deepserve-<run id>-*`, which shutdown() sweeps on every exit path.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from deepserve.cache.weight_cache import ENV_VAR as WEIGHT_CACHE_ENV
from deepserve.config import EngineConfig
from deepserve.engine.te.specs import MasterSpec, TokenizerSpec
from deepserve.errors import EngineDeadError
from deepserve.ipc.segments import free_run_id, list_segments, segment_name, unlink_segment
from deepserve.ipc.sockets import free_port, ipc_address
from deepserve.messages.pd import pd_address
from deepserve.model.config import load_model_config
from deepserve.worker.spec import WorkerSpec

log = logging.getLogger(__name__)
PRELOAD = ["torch", "deepserve.worker.worker_actor", "deepserve.engine.te.master",
           "deepserve.engine.te.tokenizer_actor", "deepserve.engine.te.launcher"]
"""What the forkserver imports once for all its children (each child's entry
point, and this module for _child_main). Not torch._dynamo: nothing in a
TE imports it (model/decoder.py keeps the meta-device init from doing so)."""
ENTRY = {"tokenizer": "deepserve.engine.te.tokenizer_actor:tokenizer_main",
         "master": "deepserve.engine.te.master:master_main",
         "worker": "deepserve.worker.worker_actor:worker_main"}


@dataclass
class _Child:
    name: str
    process: mp.Process
    death_pipe: object  # write end, held open while we live
    ready_pipe: object



class TELauncher:
    """te_id / inbox_address / report_address: set when the TE serves a node
    (its tokenizer listens at inbox_address, its master at pd_address(inbox)
    for other TEs' masters; its master reports to the CM)."""

    def __init__(self, config: EngineConfig, te_id: str = "te", inbox_address: str | None = None,
                 report_address: str | None = None, run_id: str | None = None,
                 tier_address: str = "", cache_cost_model: bool = True):
        model_config = load_model_config(config.model, config.dtype)
        self.config = config.resolve(
            model_config.max_position_embeddings,
            model_config.kv_bytes_per_block(config.block_size, config.tp))
        # a name squat under a predictable run id must not stop a (re)start
        self.run_id = free_run_id(run_id or uuid.uuid4().hex[:12])
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"ds-{self.run_id}-"))
        self.address = {name: ipc_address(self.run_dir, name)
                        for name in ("client", "tokenizer", "master", "steps", "ring")}
        if inbox_address is not None:
            self.address["tokenizer"] = inbox_address
        self.address["pd"] = pd_address(self.address["tokenizer"])
        self.te_id, self.report_address = te_id, report_address
        self.tier_address, self.cache_cost_model = tier_address, cache_cost_model  # tiers.py
        self.children: list[_Child] = []
        # startup stages, for the TE's report: each child's ready detail (a
        # worker's {"weights": "cache" | "disk", "load_s", "rank", "pid"}), and
        # seconds from start() until every child was spawned / was ready
        self.ready_details: dict[str, object] = {}
        self.spawn_s = self.ready_s = 0.0
        # forkserver: the children fork from one process that has imported torch
        # and our modules once, instead of each importing them (spawn): a TE
        # (re)starts in ~2.2 s instead of ~3.7 s on 2 idle cores, and faster
        # still when the cores are busy, which is when a TE gets replaced.
        self._mp = mp.get_context("forkserver")
        self._mp.set_forkserver_preload(PRELOAD)

    @property
    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self.children}

    def start(self) -> None:
        """Start every process and wait until all report ready (or raise)."""
        started = time.perf_counter()
        self.ready_details = {}
        try:
            self._spawn("tokenizer", ENTRY["tokenizer"], self._tokenizer_spec())
            self._spawn("master", ENTRY["master"], self._master_spec())
            init = f"tcp://127.0.0.1:{free_port()}"
            for rank in range(self.config.tp):
                self._spawn(f"worker{rank}", ENTRY["worker"], self._worker_spec(rank, init))
            self.spawn_s = time.perf_counter() - started
            self._wait_ready()
            self.ready_s = time.perf_counter() - started
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, name: str, entry: str, spec) -> None:
        death_r, death_w = self._mp.Pipe(duplex=False)
        ready_r, ready_w = self._mp.Pipe(duplex=False)
        process = self._mp.Process(target=_child_main, args=(entry, spec, death_r, ready_w),
                                   name=f"deepserve-{name}", daemon=False)
        process.start()
        death_r.close()
        ready_w.close()
        self.children.append(_Child(name, process, death_w, ready_r))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        waiting = {c.ready_pipe: c for c in self.children}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(f"TE not ready after {self.config.startup_timeout_s} s: "
                                      f"{sorted(c.name for c in waiting.values())}")
            for pipe in wait(list(waiting) + [c.process.sentinel for c in self.children], left):
                child = waiting.pop(pipe, None)
                if child is None:  # a sentinel: some process exited
                    raise EngineDeadError(f"TE process died while starting: {self.dead()}")
                status, detail = child.ready_pipe.recv()
                if status != "ready":
                    raise EngineDeadError(f"{child.name} failed to start: {detail}")
                self.ready_details[child.name] = detail

    def dead(self) -> list[str]:
        """Children that have exited, as 'name (exit code)'."""
        return [f"{c.name} (exit {c.process.exitcode})" for c in self.children
                if not c.process.is_alive()]

    def dead_names(self) -> list[str]:
        """The names of the children that have exited (worker0, master, ...)."""
        return [c.name for c in self.children if not c.process.is_alive()]

    def shutdown(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child, SIGKILL what is left after grace_s, then sweep
        the run's shared memory and run directory. Safe to call twice."""
        for c in self.children:
            if c.process.is_alive():
                c.process.terminate()
        deadline = time.monotonic() + grace_s
        for c in self.children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                log.warning("%s did not stop in %.1f s: killing", c.name, grace_s)
                c.process.kill()
                c.process.join(5)
        for c in self.children:
            c.death_pipe.close()
            c.ready_pipe.close()
        self.children = []
        for name in list_segments(segment_name(self.run_id, "")):
            unlink_segment(name)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- specs -----------------------------------------------------------------
    def _tokenizer_spec(self) -> TokenizerSpec:
        a = self.address
        return TokenizerSpec(self.config, a["tokenizer"], a["master"], a["client"], self.te_id)

    def _master_spec(self) -> MasterSpec:
        a = self.address
        return MasterSpec(self.config, segment_name(self.run_id, "steps"), a["ring"],
                          a["master"], a["steps"], a["tokenizer"], a["client"], a["pd"],
                          self.te_id, self.report_address, tier_address=self.tier_address,
                          cache_cost_model=self.cache_cost_model)

    def _worker_spec(self, rank: int, init_method: str) -> WorkerSpec:
        return WorkerSpec(self.run_id, rank, self.config, segment_name(self.run_id, "steps"),
                          self.address["ring"], self.address["steps"], init_method, self.te_id,
                          os.environ.get(WEIGHT_CACHE_ENV, ""), str(self.run_dir))


def _child_main(entry: str, spec, death_pipe, ready_pipe) -> None:
    """A child's first call: import its entry point ("module:function", from
    the forkserver's preload: no time) and run it."""
    module, function = entry.split(":")
    getattr(importlib.import_module(module), function)(spec, death_pipe, ready_pipe)
