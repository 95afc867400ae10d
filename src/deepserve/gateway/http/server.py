"""The gateway's uvicorn server: runs create_app() until SIGTERM / SIGINT, its
connections behind the guard of gateway/http/connection_guard.py."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Awaitable, Callable

import uvicorn

from deepserve.gateway.http.app import create_app
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.http.connection_guard import guarded_protocol
from deepserve.gateway.http.generation import GatewayState

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
"""Seconds uvicorn lets open connections finish after SIGTERM before cancelling them."""


def serve(config: GatewayConfig, log_level: str = "info",
          background: Callable[[uvicorn.Server, GatewayState], Awaitable[None]] | None = None
          ) -> None:
    """Run the gateway until SIGTERM / SIGINT (or `background` sets the
    server's should_exit); returns after a clean shutdown."""
    run_beside = (lambda state: background(server, state)) if background else None
    server = uvicorn.Server(server_config(config, create_app(config, run_beside),
                                         log_level=log_level, lifespan="on"))
    if threading.current_thread() is threading.main_thread():
        # uvicorn catches SIGTERM while it runs and raises it again once it has
        # shut down; with this flag-only handler in place that second delivery
        # is a no-op, so the process exits 0 instead of dying by the signal.
        signal.signal(signal.SIGTERM, _note_sigterm)
    server.run()


def server_config(config: GatewayConfig, app, **kwargs) -> uvicorn.Config:
    """uvicorn's config for the gateway: HTTP/1.1 through the connection guard
    (connection cap, read and write deadlines: gateway/http/connection_guard.py)."""
    kwargs.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    return uvicorn.Config(app, host=config.host, port=config.port,
                          http=guarded_protocol(config), **kwargs)


def _note_sigterm(signum, frame) -> None:
    logger.info("SIGTERM: gateway stopped")
