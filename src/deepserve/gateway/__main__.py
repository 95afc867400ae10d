"""The gateway process: `python -m deepserve.gateway --conf RUN_DIR/node.json --role
gateway [--parent-pid PID]` serves the HTTP app and beats from its event loop.

    uvicorn event loop ── HTTP handlers, JobClient receivers
        └─ _live (a task on the same loop) ──Ready, Heartbeat (PUSH)──> supervisor
                                           parent gone ──> server.should_exit

Its config is the gateway's part of the node's resolved config
(GatewayConfig.from_node): API keys come in that file (0600, in the run
directory), never in argv where `ps` would show them.

The heartbeat is sent from the event loop itself, so a stuck loop stops
beating and the supervisor replaces the gateway. Its progress counter is the
loop's own tick: a counter of replies would call a gateway hung whose
requests merely wait in a busy TE's queue.
"""

from __future__ import annotations

import asyncio
import os

import uvicorn

from deepserve.actor import ActorLife
from deepserve.config.child import ChildArgs, parse_child_args, print_config
from deepserve.config.loading import read_run_config
from deepserve.gateway.http.server import serve
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.http.generation import GatewayState

BEAT_S = 0.25
"""Seconds between the loop's checks (the heartbeat itself is rate-limited by ActorLife)."""


def load_settings(args: ChildArgs) -> GatewayConfig:
    config, _ = read_run_config(args.conf)
    return GatewayConfig.from_node(config)


def main(argv: list[str] | None = None) -> None:
    args = parse_child_args(argv, "gateway", "DeepServe HTTP gateway (OpenAI API)")
    config = load_settings(args)
    if args.print_config:
        return print_config(config)
    life = ActorLife("gateway", parent_pid=args.parent_pid, signals=False)  # uvicorn's signals
    try:
        serve(config, log_level=os.environ.get("DEEPSERVE_LOG_LEVEL", "warning").lower(),
              background=lambda server, state: _live(life, server, state))
    finally:
        life.close()


async def _live(life: ActorLife, server: uvicorn.Server, state: GatewayState) -> None:
    """Ready once serving, then beat from the loop; ask uvicorn to exit once
    the parent is gone (it then shuts down cleanly, as on SIGTERM)."""
    while not server.started and not server.should_exit:
        await asyncio.sleep(0.05)
    life.ready(port=state.config.port)
    num_ticks = 0
    while not life.should_stop():
        num_ticks += 1
        open_requests = state.client.num_open_requests
        life.beat({"ticks": num_ticks, "open_requests": open_requests}, open_requests > 0)
        await asyncio.sleep(BEAT_S)
    server.should_exit = True


if __name__ == "__main__":
    main()
