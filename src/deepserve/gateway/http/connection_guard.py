"""ConnectionGuard: uvicorn's HTTP/1.1 protocol (h11) with the limits a public port needs.

    accept ──> connection_made ── over max_connections? its requests get 503 + close
      read deadline  armed when it opens and when a response ends
                     disarmed once a whole request (head and body) is in      past it: abort
      write deadline armed when our send buffer holds bytes the client has not taken
                     disarmed when the buffer is empty again                   past it: abort

Why a protocol and not ASGI middleware: a connection that never sends a
request never reaches the app (uvicorn's timeout_keep_alive starts only after
a first response; tests/gateway/test_flow_control.py shows it), and a client
that stops reading blocks uvicorn's send() in drain(), where no ASGI code runs.
Why abort() and not close(): close() waits for the unread bytes to flush,
which for such a client is never.

Aborting runs uvicorn's connection_lost: the request's cycle is marked
disconnected and its blocked send returns, Starlette's disconnect listener
cancels the streaming response, and ClosingStreamingResponse closes the reply
stream, which aborts the sub-requests at the JE (gateway/http/generation.py).

The send buffer's high-water mark is 0: writing pauses as soon as the kernel
does not take a whole write and resumes when our buffer is empty, so "paused"
means exactly "bytes waiting on the client" (the kernel's socket buffers
still absorb a reading client's bursts).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.errors import APIError, error_response

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardLimits:
    max_connections: int
    read_timeout_s: float
    write_timeout_s: float


def guarded_protocol(config: GatewayConfig) -> type[H11Protocol]:
    """The protocol class to pass to uvicorn.Config(http=...) for `config`."""
    limits = GuardLimits(config.max_connections, config.read_timeout_s, config.write_timeout_s)
    return type("GuardedH11Protocol", (ConnectionGuard,), {"limits": limits})


async def refuse_connection(scope, receive, send) -> None:
    """The app of a connection past max_connections: 503, then close."""
    response = error_response(APIError.unavailable(
        "Too many connections to the gateway; retry later.", "too_many_connections"))
    response.headers["connection"] = "close"
    response.headers["retry-after"] = "1"
    await response(scope, receive, send)


class ConnectionGuard(H11Protocol):
    limits = GuardLimits(max_connections=1024, read_timeout_s=15.0, write_timeout_s=30.0)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=0)
        if len(self.connections) > self.limits.max_connections:
            logger.warning("%d connections open: refusing one", len(self.connections))
            self.app = refuse_connection
        self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._has_whole_request():
            self._read_timer = _cancel(self._read_timer)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already in
        self._read_timer = _cancel(self._read_timer)
        if not self.transport.is_closing() and not self._has_whole_request():
            self._read_timer = self.loop.call_later(self.limits.read_timeout_s,
                                                    self._read_timeout)

    def _has_whole_request(self) -> bool:
        """A request's head and body are in and its response is not finished."""
        cycle = self.cycle
        return cycle is not None and not cycle.more_body and not cycle.response_complete

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s,
                                                     self._write_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._write_timer = _cancel(self._write_timer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._read_timer = _cancel(self._read_timer)
        self._write_timer = _cancel(self._write_timer)
        super().connection_lost(exc)

    def _read_timeout(self) -> None:
        self._read_timer = None
        logger.info("%s sent no whole request within %g s: connection closed",
                    self.client, self.limits.read_timeout_s)
        self.transport.abort()

    def _write_timeout(self) -> None:
        self._write_timer = None
        logger.warning("%s left %d response bytes unread for %g s: connection cut off",
                       self.client, self.transport.get_write_buffer_size(),
                       self.limits.write_timeout_s)
        self.transport.abort()


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
    return None
