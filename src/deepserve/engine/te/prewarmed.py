"""A pre-warmed TE process: everything a TE needs before it knows its model.

    node ──python -m deepserve.engine.te.te_server --te-id pool3 --pool──> this process:
        starts the forkserver that forks the TE's tokenizer, master and
        workers (it imports torch and their modules, once: this process
        imports neither), binds its inbox, says Ready(component=pool3) to
        the supervisor, waits
    supervisor ──Assign(te_id, model, run_id)──> inbox ──> te_server (run_main) as that TE

DeepServe's Scaler-Pre and TE-Pre-Load, moved off the critical path: a
scale-out (or the replacement of a crashed TE) that finds one ready skips
the interpreter start, the imports and the forkserver start (1.8 s on 2
idle cores, 3.4 s with both busy: tools in the issue 25 note). It is model-agnostic and parallelism-agnostic: the Assign names the
model, and the workers (tp of them) are forked only then. It holds no shared
memory until it is assigned; it exits when its parent (the node) is gone,
or on SIGTERM (default action: nothing to clean up yet).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from multiprocessing import forkserver

import zmq

from deepserve.engine.te.launcher import PRELOAD
from deepserve.ipc.heartbeat import ENV_VAR as HEARTBEAT_ENV
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.messages.health import Ready
from deepserve.messages.scaling import Assign

log = logging.getLogger(__name__)
POLL_S = 0.5


def prewarm() -> float:
    """Start the forkserver now, preloaded like TELauncher's, and fork one
    process through it (so its imports are done); seconds it took."""
    started = time.perf_counter()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    probe = ctx.Process(target=_noop, name="deepserve-prewarm")
    probe.start()
    probe.join(120)
    return time.perf_counter() - started


def _noop() -> None:
    pass


def wait_for_assignment(name: str, inbox: str, parent_pid: int | None) -> Assign | None:
    """Warm up, tell the supervisor, wait for the Assign; None: the parent is gone."""
    warm_s = prewarm()
    ctx = zmq.Context()
    pull = PullSocket(ctx, inbox, bind=True, type=Assign)
    address = os.environ.get(HEARTBEAT_ENV)
    push = PushSocket(ctx, address, bind=False) if address else None
    try:
        if push is not None:  # open until assigned: closing at once could drop it unsent
            try:
                push.put(Ready(component=name, pid=os.getpid(), time=time.monotonic(),
                               details={"pool": True, "warm_s": round(warm_s, 3)}), timeout=5)
            except TimeoutError:
                log.warning("%s: the supervisor does not listen", name)
        while parent_pid is None or os.getppid() == parent_pid:
            try:
                return pull.get(timeout=POLL_S)
            except TimeoutError:
                continue
        return None
    finally:
        pull.close()
        if push is not None:
            push.close()
        ctx.term()
