"""ReplyStream: what one HTTP request reads, the replies of its sub-requests.

    JobClient._recv_replies ──(index, RequestDelta | RequestFailed | SHUTDOWN)──> asyncio.Queue
        ──> ReplyStream: wait_started() / async for (index, delta) / close()

The stream owns the request's deadline and notices a client that went away;
closing it aborts (JobClient.abort) every sub-request still open. Its queue
is bounded (GatewayConfig.max_queued_replies): a reply that finds it full
means the HTTP writer is stuck on a client that does not read, so the stream
is cut off: its sub-requests are aborted at once (their TE slots freed) and
the writer, if it ever gets to read again, meets an error. A stream counts
toward max_open_requests until it is closed, cut off or not.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Awaitable, Callable

from deepserve.gateway.errors import APIError
from deepserve.messages.engine import RequestDelta, RequestFailed

DISCONNECT_POLL_S = 0.5
"""How often a reply stream asks whether its client is gone (non-streaming,
and streaming before the 200; after it, Starlette cancels the stream)."""
SHUTDOWN = object()
IsDisconnected = Callable[[], Awaitable[bool]]


class ClientDisconnected(APIError):
    def __init__(self):  # 499: nginx's "client closed request"; nobody reads it
        super().__init__(499, "The client closed the request.", "client_closed")


class ClientTooSlow(APIError):
    def __init__(self, num_queued: int):
        super().__init__(503, f"The client did not read its stream ({num_queued} replies "
                         "waiting); the request was aborted.", "service_unavailable",
                         None, "client_too_slow")


class ReplyStream:
    """Replies of the sub-requests of one HTTP request, as (index, RequestDelta).

    Ends after every sub-request's last delta. A RequestFailed raises the
    matching APIError; so does the deadline (504) and a shutdown (503).
    `close()` aborts whatever has not finished; call it on every exit path.
    """

    def __init__(self, request_ids: list[str], queue: asyncio.Queue, timeout_s: float,
                 abort: Callable[[str], None], is_disconnected: IsDisconnected | None,
                 tenant: str = ""):
        self.request_ids = request_ids
        self.tenant = tenant  # whose open requests it counts toward (open_share.py)
        self._abort = abort
        self.queue = queue
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self.is_disconnected = is_disconnected
        self._next_disconnect_check = time.monotonic() + DISCONNECT_POLL_S
        self._buffer: deque[tuple[int, RequestDelta]] = deque()
        self._started: set[int] = set()
        self._num_finished = 0
        self.is_closed = False
        self.is_cut_off = False

    def __aiter__(self) -> "ReplyStream":
        return self

    async def __anext__(self) -> tuple[int, RequestDelta]:
        if self._buffer:
            return self._buffer.popleft()
        if self._num_finished == len(self.request_ids):
            raise StopAsyncIteration
        return await self._next()

    async def wait_started(self) -> None:
        """Wait until every sub-request has its first reply (kept for iteration)."""
        while len(self._started) < len(self.request_ids):
            self._buffer.append(await self._next())

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            for request_id in self.request_ids:
                self._abort(request_id)

    def cut_off(self) -> None:
        """Abort every sub-request now (the client is not reading); the stream
        stays open, and counted, until its writer closes it."""
        if not self.is_cut_off:
            self.is_cut_off = True
            for request_id in self.request_ids:
                self._abort(request_id)

    async def _next(self) -> tuple[int, RequestDelta]:
        index, msg = await self._get()
        if msg is SHUTDOWN:
            raise APIError.unavailable("The gateway is shutting down.", "shutting_down")
        self._started.add(index)
        if isinstance(msg, RequestFailed):
            self._num_finished += 1
            raise APIError.from_failure(msg.error, msg.message, msg.param, msg.retry_after_s)
        if msg.finish_reason is not None:
            self._num_finished += 1
        return index, msg

    async def _get(self) -> tuple[int, object]:
        while True:
            now = time.monotonic()
            if self.is_cut_off:
                raise ClientTooSlow(self.queue.qsize())
            if now >= self._deadline:
                raise APIError.timeout(self._timeout_s)
            if not self.queue.empty():
                return self.queue.get_nowait()
            if self.is_disconnected is not None and now >= self._next_disconnect_check:
                if await self.is_disconnected():
                    raise ClientDisconnected()
                self._next_disconnect_check = now + DISCONNECT_POLL_S
            # Streaming, nothing asks (Starlette notices the client going): no
            # poll, one wake-up per reply (a stale check time woke it every ms).
            wake = self._deadline if self.is_disconnected is None else \
                min(self._deadline, self._next_disconnect_check)
            wait_s = wake - now
            try:  # a timer, not wait_for's task per reply (one wake-up per token)
                async with asyncio.timeout(max(wait_s, 0.001)):
                    return await self.queue.get()
            except TimeoutError:
                pass
