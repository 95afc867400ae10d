"""A TE serving a node: `python -m deepserve.engine.te_server ...`.

    JE ──SubmitRequest──> [inbox: this TE's tokenizer] ... (a TELauncher's processes)
    this process ──TEUp / TEDown──> cluster manager;  its master ──TEReport──> CM

It starts the TE's processes, serves one warm-up request through them (a
TE joins the TE list only once it has served), announces the TE, and
watches them: when one dies it announces TEDown, stops the rest and exits
non-zero (the node's supervisor restarts it). SIGTERM stops it cleanly; so
does its parent's death.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time

import zmq

from deepserve.actor import ActorLife
from deepserve.config import EngineConfig
from deepserve.engine.launcher import TELauncher
from deepserve.drill.hooks import FaultHooks
from deepserve.ipc.sockets import PullSocket, PushSocket, ipc_address
from deepserve.messages.control import TEDown, TEInfo, TEUp
from deepserve.messages.engine import RequestDelta, RequestFailed, SubmitRequest, ToClient
from deepserve.messages.sampling import SamplingParams

log = logging.getLogger(__name__)
TEUP_INTERVAL_S = 2.0


def serve(config: EngineConfig, te_id: str, inbox: str, cm_address: str, te_type: str,
          served_model: str, parent_pid: int | None, run_id: str | None = None) -> int:
    life = ActorLife(f"te-{te_id}", parent_pid=parent_pid)
    hooks = FaultHooks.from_env(te_id)
    if hooks is not None and hooks.active("crash") is not None:
        raise SystemExit(f"drill: TE {te_id} crashes at start")
    launcher = TELauncher(dataclasses.replace(config, processes=True), te_id, inbox, cm_address,
                          run_id)
    ctx = zmq.Context()
    to_cm = PushSocket(ctx, cm_address, bind=False)
    sink = PullSocket(ctx, launcher.address["client"], bind=True, type=ToClient)
    status = 0
    try:
        launcher.start()
        _warm_up(ctx, launcher, life)
        up = TEUp(info=TEInfo(te_id=te_id, te_type=te_type, model=served_model, address=inbox,
                              num_devices=config.tp, block_size=launcher.config.block_size))
        last_up = 0.0
        while not life.should_stop():
            if time.monotonic() - last_up > TEUP_INTERVAL_S:  # a restarted CM hears it again
                try:
                    to_cm.put(up, timeout=1.0)
                except TimeoutError:
                    pass
                last_up = time.monotonic()
            if launcher.dead():
                log.error("TE %s lost a process: %s", te_id, launcher.dead())
                status = 1
                break
            sink.drain()  # failures the master sends its own caller: the JE hears of them via the CM
            time.sleep(0.2)
    finally:
        reason = "shutdown" if status == 0 else f"process died: {launcher.dead()}"
        try:
            to_cm.put(TEDown(te_id=te_id, reason=reason), timeout=1.0)
        except TimeoutError:
            pass  # the cluster manager is gone (node shutting down)
        launcher.shutdown()
        time.sleep(0.05)  # let TEDown leave before the context closes
        sink.close()
        to_cm.close()
        ctx.term()
    return status


def _warm_up(ctx: zmq.Context, launcher: TELauncher, life: ActorLife,
             timeout_s: float = 60.0) -> None:
    """One short greedy request end to end (tokenizer, master, workers)."""
    reply = ipc_address(launcher.run_dir, "warm-up")
    sink = PullSocket(ctx, reply, bind=True, type=ToClient)
    inbox = PushSocket(ctx, launcher.address["tokenizer"], bind=False)
    try:
        inbox.put(SubmitRequest(request_id="warm-up", prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(max_tokens=2, temperature=0.0,
                                                        ignore_eos=True), reply_to=reply))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not life.should_stop():
            try:
                msg = sink.get(timeout=0.2)
            except TimeoutError:
                if launcher.dead():
                    break
                continue
            if isinstance(msg, RequestFailed):
                raise RuntimeError(f"warm-up request failed: {msg.message}")
            if isinstance(msg, RequestDelta) and msg.finish_reason is not None:
                return
        raise RuntimeError(f"warm-up request not served in {timeout_s:g} s: {launcher.dead()}")
    finally:
        sink.close()
        inbox.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--te-id", required=True)
    ap.add_argument("--inbox", required=True, help="ipc:// address the tokenizer binds")
    ap.add_argument("--cm", required=True, help="the cluster manager's inbox address")
    ap.add_argument("--te-type", default="colocated")
    ap.add_argument("--served-model", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--run-id", default=None,
                    help="names this TE's shared memory (the supervisor sweeps it after a kill)")
    ap.add_argument("--options", default="{}", help="engine options as JSON")
    args = ap.parse_args(argv)
    import json
    options = {**json.loads(args.options), "processes": True}
    config = EngineConfig.from_options(args.model, **options)
    raise SystemExit(serve(config, args.te_id, args.inbox, args.cm, args.te_type,
                           args.served_model or os.path.basename(args.model), args.parent_pid,
                           args.run_id))


if __name__ == "__main__":
    main()
