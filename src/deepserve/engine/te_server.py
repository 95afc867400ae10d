"""A TE serving a node: `python -m deepserve.engine.te_server ...`.

    JE ──SubmitRequest──> [inbox: this TE's tokenizer] ... (a TELauncher's processes)
    this process ──TEUp / TEDown──> cluster manager;  its master ──TEReport──> CM

It starts the TE's processes, announces the TE, and watches them: when one
dies it announces TEDown and stops the rest (the supervisor restarts TEs in a
later issue). SIGTERM stops it cleanly; so does its parent's death.
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
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.messages.control import TEDown, TEInfo, TEUp
from deepserve.messages.engine import ToClient

log = logging.getLogger(__name__)


def serve(config: EngineConfig, te_id: str, inbox: str, cm_address: str, te_type: str,
          served_model: str, parent_pid: int | None) -> int:
    life = ActorLife(f"te-{te_id}", parent_pid=parent_pid)
    launcher = TELauncher(dataclasses.replace(config, processes=True), te_id, inbox, cm_address)
    ctx = zmq.Context()
    to_cm = PushSocket(ctx, cm_address, bind=False)
    sink = PullSocket(ctx, launcher.address["client"], bind=True, type=ToClient)
    status = 0
    try:
        launcher.start()
        to_cm.put(TEUp(info=TEInfo(te_id=te_id, te_type=te_type, model=served_model,
                                   address=inbox, num_devices=config.tp,
                                   block_size=launcher.config.block_size)))
        while not life.should_stop():
            if launcher.dead():
                log.error("TE %s lost a process: %s", te_id, launcher.dead())
                status = 1
                break
            sink.drain()  # failures the master sends its own caller: the JE hears of them via the CM
            time.sleep(0.2)
    finally:
        reason = "shutdown" if status == 0 else f"process died: {launcher.dead()}"
        to_cm.put(TEDown(te_id=te_id, reason=reason))
        launcher.shutdown()
        time.sleep(0.05)  # let TEDown leave before the context closes
        sink.close()
        to_cm.close()
        ctx.term()
    return status


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--te-id", required=True)
    ap.add_argument("--inbox", required=True, help="ipc:// address the tokenizer binds")
    ap.add_argument("--cm", required=True, help="the cluster manager's inbox address")
    ap.add_argument("--te-type", default="colocated")
    ap.add_argument("--served-model", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--options", default="{}", help="engine options as JSON")
    args = ap.parse_args(argv)
    import json
    config = EngineConfig.from_options(args.model, **json.loads(args.options))
    raise SystemExit(serve(config, args.te_id, args.inbox, args.cm, args.te_type,
                           args.served_model or os.path.basename(args.model), args.parent_pid))


if __name__ == "__main__":
    main()
