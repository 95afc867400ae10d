"""`python -m deepserve.gateway --je ADDR --cm ADDR --reply ADDR [--port N] ...`

API keys come from DEEPSERVE_API_KEYS="key1:tenantA,key2:tenantB" (never argv,
where `ps` would show them).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time

from deepserve.gateway.app import serve
from deepserve.gateway.config import GatewayConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deepserve.gateway",
                                description="DeepServe HTTP gateway (OpenAI API)")
    p.add_argument("--je", required=True, help="job executor PULL address to push requests to")
    p.add_argument("--cm", required=True, help="cluster manager PUB address to subscribe to")
    p.add_argument("--reply", required=True, help="address to bind the reply PULL socket on")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="deepserve", help="served model name")
    p.add_argument("--max-open-requests", type=int, default=256)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--max-prompt-chars", type=int, default=1_000_000)
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--log-level", default="info")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="stop (SIGTERM to self) once this process is no longer the parent")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig.from_env(
        je_address=args.je, cm_address=args.cm, reply_address=args.reply, host=args.host,
        port=args.port, served_model=args.model, max_open_requests=args.max_open_requests,
        request_timeout_s=args.request_timeout, max_prompt_chars=args.max_prompt_chars,
        default_max_tokens=args.default_max_tokens)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    serve(config_from_args(args), log_level=args.log_level)


def _watch_parent(parent_pid: int) -> None:
    """uvicorn owns the main thread; a daemon thread turns the parent's death
    into our own SIGTERM, which uvicorn handles as a clean shutdown."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
