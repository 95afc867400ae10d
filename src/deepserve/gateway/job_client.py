"""The gateway's ZeroMQ side: submit to the JE, route replies, follow the CM.

    handlers ──submit() / abort()──> PUSH ──SubmitRequest / AbortRequest──> JE
    TE tokenizers, JE ──RequestDelta / RequestFailed──> PULL (reply_address)
        └─ _recv_replies ──> _routes[request_id].queue ──> ReplyStream (one per HTTP request)
    CM PUB ──TEList / TEReport──> SUB ─ _recv_cluster ──> te_ids, reports (health, metrics)

Everything runs on the server's event loop thread, which owns every socket.
The PUSH socket is a plain socket used with NOBLOCK, so submitting and
aborting never await: an abort can go out from the `finally` of a cancelled
task. A route lives from submit until its sub-request's last reply or its
abort; replies for ids without a route (late, after an abort) are dropped.

Resuming: when the JE says a sub-request's TE was lost (or a TE says its KV
transfer failed: RETRYABLE_ERRORS), the route resubmits it as attempt n+1
with prompt = its prompt ids + every token already streamed and max_tokens
reduced by as many, so the stream goes on with no gap and no repeat. Deltas
of an earlier attempt that arrive late are dropped; the resumed attempt's
prompt fields are not passed on (the caller's prompt did not change). The JE
decides when attempts run out (then the error is engine_dead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import msgspec
import zmq
import zmq.asyncio

from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.errors import APIError
from deepserve.gateway.metrics import GatewayMetrics, RequestTiming
from deepserve.gateway.reply_stream import SHUTDOWN, IsDisconnected, ReplyStream
from deepserve.ipc.sockets import PushSocket
from deepserve.messages.control import FromClusterManager, TEInfo, TEList, TEReport
from deepserve.messages.engine import (RETRYABLE_ERRORS, AbortRequest, RequestDelta,
                                       RequestFailed, SubmitRequest)
from deepserve.messages.engine import ToClient
from deepserve.messages.sampling import SamplingParams

logger = logging.getLogger(__name__)

REPORT_TTL_S = 10.0
"""Before the first TEList arrives, a TE that sent a TEReport this recently counts as up."""


@dataclass
class _Route:
    queue: asyncio.Queue
    index: int
    submit: SubmitRequest
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(time.monotonic()))
    is_started: bool = False
    prompt_token_ids: list[int] | None = None  # from the first delta
    token_ids: list[int] = field(default_factory=list)  # streamed so far
    attempt: int = 0


class JobClient:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None):
        self.config = config
        self.metrics = metrics
        self._routes: dict[str, _Route] = {}
        self._tes: dict[str, TEInfo] = {}
        self._has_te_list = False
        self._reports: dict[str, TEReport] = {}
        self._report_times: dict[str, float] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._sockets: list = []
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        try:
            self._push = PushSocket(zmq.Context.shadow(self._ctx), self.config.je_address,
                                    bind=False)
            self._sockets.append(self._push)
            self._pull = self._open(zmq.PULL, self.config.reply_address, bind=True)
            self._sub = self._open(zmq.SUB, self.config.cm_address, bind=False)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        except BaseException:
            await self.close()
            raise
        self._tasks = [asyncio.create_task(self._recv_replies(), name="gateway-replies"),
                       asyncio.create_task(self._recv_cluster(), name="gateway-cluster")]

    async def close(self) -> None:
        """Stop receiving, abort open sub-requests, wake their streams, close sockets."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for request_id, route in list(self._routes.items()):
            route.queue.put_nowait((route.index, SHUTDOWN))
            self.abort(request_id)
        for sock in reversed(self._sockets):
            sock.close()  # linger 0, set when opened
        self._sockets = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _open(self, kind: int, addr: str, bind: bool) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        sock.bind(addr) if bind else sock.connect(addr)
        return sock

    # -- requests --------------------------------------------------------------
    def submit(self, request_id: str, samplings: Sequence[SamplingParams], *,
               prompt: str | None = None, prompt_token_ids: list[int] | None = None,
               messages: list[dict] | None = None, salt: str | None = None,
               is_disconnected: IsDisconnected | None = None) -> ReplyStream:
        """Send one SubmitRequest per sampling (ids `{request_id}-{i}`); 503 with
        no TE, 429 past max_open_requests, 400 for text that cannot be sent."""
        if not self.te_ids:
            raise APIError.unavailable("No engine is available to serve the request.")
        if len(self._routes) + len(samplings) > self.config.max_open_requests:
            raise APIError.overloaded(len(self._routes))
        ids = [f"{request_id}-{i}" for i in range(len(samplings))]
        submits = [SubmitRequest(
            request_id=rid, prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages,
            sampling=sampling, salt=salt, reply_to=self.config.reply_address)
            for rid, sampling in zip(ids, samplings)]
        payloads = [self._encode(submit) for submit in submits]
        queue: asyncio.Queue = asyncio.Queue()
        stream = ReplyStream(ids, queue, self.config.request_timeout_s, self.abort, is_disconnected)
        for index, (rid, payload) in enumerate(zip(ids, payloads)):
            self._routes[rid] = _Route(queue, index, submits[index])
            if not self._send(payload):
                stream.close()
                raise APIError.unavailable("The job executor is not accepting requests.",
                                           "job_executor_busy")
        return stream

    def abort(self, request_id: str) -> None:
        """Forget the sub-request and tell the JE to abort it (if it is open)."""
        if self._routes.pop(request_id, None) is not None:
            self._send(self._encoder.encode(AbortRequest(request_id=request_id)))

    def _encode(self, msg: SubmitRequest) -> bytes:
        try:
            return self._encoder.encode(msg)
        except (UnicodeEncodeError, OverflowError, msgspec.EncodeError) as exc:
            raise APIError.bad_request(f"The request cannot be encoded: {exc}") from None

    def _send(self, payload: bytes) -> bool:
        try:
            self._push.socket.send(payload, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            logger.warning("JE queue full: dropped a message to %s", self.config.je_address)
            return False

    def _resume(self, request_id: str, route: _Route) -> bool:
        """Resubmit a sub-request whose TE was lost, from where its stream is."""
        first = route.submit
        if route.token_ids and route.prompt_token_ids is None:
            return False  # cannot happen: the first delta carries the prompt ids
        sampling = msgspec.structs.replace(
            first.sampling, max_tokens=first.sampling.max_tokens - len(route.token_ids))
        if sampling.max_tokens < 1:
            return False
        route.attempt += 1
        if route.prompt_token_ids is None:  # nothing streamed: the same request again
            resumed = msgspec.structs.replace(first, attempt=route.attempt)
        else:
            resumed = msgspec.structs.replace(
                first, prompt=None, messages=None, sampling=sampling, attempt=route.attempt,
                prompt_token_ids=route.prompt_token_ids + route.token_ids)
        logger.warning("resuming %s (attempt %d) after %d tokens", request_id, route.attempt,
                       len(route.token_ids))
        return self._send(self._encoder.encode(resumed))

    # -- views -----------------------------------------------------------------
    @property
    def num_open_requests(self) -> int:
        return len(self._routes)

    @property
    def num_running(self) -> int:
        return sum(route.is_started for route in self._routes.values())

    @property
    def num_waiting(self) -> int:
        return self.num_open_requests - self.num_running

    @property
    def te_ids(self) -> list[str]:
        """TEs up: those of the latest TEList; before the first one arrives,
        those that reported within REPORT_TTL_S (a late subscriber's view)."""
        if self._has_te_list:
            return list(self._tes)
        now = time.monotonic()
        return [te for te, t in self._report_times.items() if now - t < REPORT_TTL_S]

    @property
    def reports(self) -> dict[str, TEReport]:
        return dict(self._reports)

    # -- receivers -------------------------------------------------------------
    async def _recv_replies(self) -> None:
        await _recv_forever(self._pull, ToClient, self._on_reply, "reply")

    def _on_reply(self, msg) -> None:
        if isinstance(msg, (RequestDelta, RequestFailed)):
            self._route_reply(msg)  # no await: a reply is routed whole or not at all

    def _route_reply(self, msg: RequestDelta | RequestFailed) -> None:
        route = self._routes.get(msg.request_id)
        if route is None:
            return  # aborted or unknown: nobody waits for it
        if isinstance(msg, RequestDelta):
            if msg.attempt != route.attempt:
                return  # a late delta of a lost attempt: its tokens are being redone
            if route.attempt:
                msg.prompt = msg.prompt_token_ids = None
            elif msg.prompt_token_ids is not None:
                route.prompt_token_ids = msg.prompt_token_ids
            route.token_ids.extend(msg.token_ids)
        elif msg.error in RETRYABLE_ERRORS and self._resume(msg.request_id, route):
            return
        now = time.monotonic()
        route.is_started = True
        is_last = isinstance(msg, RequestFailed) or msg.finish_reason is not None
        if isinstance(msg, RequestDelta) and msg.token_ids:
            route.timing.first_token_at = route.timing.first_token_at or now
            route.timing.num_tokens += len(msg.token_ids)
        route.queue.put_nowait((route.index, msg))
        if is_last:
            del self._routes[msg.request_id]
            route.timing.finished_at = now
            if self.metrics is not None and isinstance(msg, RequestDelta):
                self.metrics.observe_request(route.timing)

    async def _recv_cluster(self) -> None:
        await _recv_forever(self._sub, FromClusterManager, self._on_cluster, "cluster")

    def _on_cluster(self, msg) -> None:
        if isinstance(msg, TEList):
            self._tes = {te.te_id: te for te in msg.tes}
            self._has_te_list = True
            for te_id in set(self._reports) - set(self._tes):
                del self._reports[te_id]
                self._report_times.pop(te_id, None)
        else:
            self._reports[msg.te_id] = msg
            self._report_times[msg.te_id] = time.monotonic()
            if self.metrics is not None:
                self.metrics.observe_te_report(msg)


async def _recv_forever(sock, message_type, handle, what: str) -> None:
    """Decode and hand on every message of an asyncio ZeroMQ socket; a
    message that does not decode is logged and dropped, never fatal."""
    decoder = msgspec.msgpack.Decoder(message_type)
    while True:
        data = await sock.recv()
        try:
            msg = decoder.decode(data)
        except msgspec.DecodeError as exc:
            logger.warning("undecodable %s message dropped: %s", what, exc)
            continue
        handle(msg)
