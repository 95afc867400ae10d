"""The gateway's ZeroMQ side: submit to the JE, route replies, follow the CM and the JE.

    handlers ──submit() / abort()──> PUSH ──SubmitRequest / AbortRequest──> JE
    PUSH's monitor ──connected / disconnected──> JELink (je_link.py) ──> _on_new_je: resume
    TE tokenizers, JE ──RequestDelta / RequestFailed──> PULL (reply_address)
        └─ _recv_replies ──> routes (routes.py) ──bounded queue──> ReplyStream (one per HTTP request)
    CM PUB ──TEList / TEReport──> SUB ──> ClusterView (cluster_view.py): te_ids, reports

Everything runs on the server's event loop thread, which owns every socket.
The PUSH socket is a plain socket used with NOBLOCK, so submitting and
aborting never await: an abort can go out from the `finally` of a cancelled
task. Replies for wire ids without a route (late, after an abort, or of an
attempt a JE restart replaced) are dropped.

Resuming (routes.next_attempt): when the JE says a sub-request's TE was lost
(or a TE says its KV transfer failed: RETRYABLE_ERRORS), the route resubmits
it as attempt n+1 from where its stream is, so the stream goes on with no gap
and no repeat. Deltas of an earlier attempt that arrive late are dropped; the
resumed attempt's prompt fields are not passed on (the caller's prompt did
not change). The JE decides when attempts run out (then: engine_dead).

A JE restart is resumed the same way (je_link.py ends a JE incarnation when
its process goes): every sub-request sent to an incarnation that ended is
resubmitted to the next one as attempt n+1 under a new wire id
`{id}.je{epoch}`, so the old attempt's deltas are dropped here; the old
attempt is aborted at every listed TE (nobody else knows it now) and at the
new JE (its submission may still be in the pipe). So nothing lost inside the
dead JE is lost, and the new JE learns every open task: a TE crash after the
JE restart still migrates them. Sub-requests sent while no JE is there wait
in the PUSH's pipe for the next one (bounded by their deadline and the
pipe's high-water mark): they are not refused. With standby heads the PUSH
connects to every head's JE with ZMQ_IMMEDIATE (a pipe to a head that is not
there would hold messages forever): there is no pipe to wait in, so a
submission (or a resumed attempt) that finds no JE is held by the JELink
(send_or_hold) and sent, in order, once a JE takes it.

Admission counts open *streams* (ReplyStream not yet closed), not routes: a
stream whose TE has finished but whose client has not read it still holds a
place until its writer closes it (gateway/http/connection_guard.py cuts such a
client off after write_timeout_s).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Sequence

import msgspec
import zmq
import zmq.asyncio

from deepserve.gateway.link.cluster_view import ClusterView
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.errors import APIError
from deepserve.gateway.link.je_link import JELink
from deepserve.gateway.link.latency_samples import LatencySamples
from deepserve.gateway.link.open_share import admits, open_by_tenant
from deepserve.gateway.metrics import GatewayMetrics
from deepserve.gateway.link.reply_stream import SHUTDOWN, IsDisconnected, ReplyStream
from deepserve.gateway.link.routes import Route, RouteTable, next_attempt, reply_ids
from deepserve.ipc import curve
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import bind_or_connect
from deepserve.messages.control import FromClusterManager, TEReport
from deepserve.messages.contexts import TurnDone
from deepserve.messages.engine import (RETRYABLE_ERRORS, AbortRequest, ChatOptions, RequestDelta,
                                       RequestFailed, SubmitRequest, ToClient)
from deepserve.messages.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_ORPHANS = 4096
"""Orphan wire ids remembered (each aborted once): a gateway restarted under
load gets deltas of its predecessor's streams and stops their TEs."""


class JobClient:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None):
        self.config = config
        self.metrics = metrics
        self.cluster = ClusterView(metrics)
        self._routes = RouteTable(metrics)
        self._orphans: dict[str, None] = {}  # wire ids aborted already (bounded, FIFO)
        self._streams: weakref.WeakSet[ReplyStream] = weakref.WeakSet()
        self._je = JELink(self._on_new_je)
        self._te_outboxes: Outboxes | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._latencies = LatencySamples()  # the autoscaler's SLO samples, to the JE
        self._calls: dict[str, tuple[asyncio.Future, int]] = {}  # context calls: id ->
        # (its answer, the JE epoch it was sent to)
        self._ctx: zmq.asyncio.Context | None = None
        self._sockets: list = []
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        try:
            self._push, monitor = self._je.open(self._ctx, self.config.je_address)
            self._sockets += [self._push, monitor]
            self._te_outboxes = Outboxes(zmq.Context.shadow(self._ctx), timeout_s=0.0)
            self._pull = self._open(zmq.PULL, self.config.reply_address, bind=True)
            self._sub = self._open(zmq.SUB, self.config.cm_address, bind=False)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        except BaseException:
            await self.close()
            raise
        self._tasks = [asyncio.create_task(self._recv_replies(), name="gateway-replies"),
                       asyncio.create_task(self._recv_cluster(), name="gateway-cluster"),
                       asyncio.create_task(self._je.watch(), name="gateway-je-link")]
        if self._je.to_heads:
            self._tasks.append(asyncio.create_task(self._je.flush_forever(self._sending_held),
                                                   name="gateway-held"))

    async def close(self) -> None:
        """Stop receiving, abort open sub-requests, wake their streams, close sockets."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for route in self._routes:
            self._deliver(route, SHUTDOWN)
            self.abort(route.request_id)
        self._je.close()
        if self._te_outboxes is not None:
            self._te_outboxes.close()
            self._te_outboxes = None
        for sock in reversed(self._sockets):
            sock.close(linger=0)
        self._sockets = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _open(self, kind: int, addr: str, bind: bool) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        curve.secure(sock, addr, bind)
        bind_or_connect(sock, addr, bind)
        return sock

    # -- requests --------------------------------------------------------------
    def submit(self, request_id: str, samplings: Sequence[SamplingParams], *,
               prompt: str | None = None, prompt_token_ids: list[int] | None = None,
               messages: list[dict] | None = None, chat: ChatOptions | None = None,
               salt: str | None = None, model: str | None = None,
               context_id: str | None = None, is_disconnected: IsDisconnected | None = None
               ) -> ReplyStream:
        """Send one SubmitRequest per sampling (ids `{request_id}-{i}`); 503 with
        no TE, 429 past max_open_requests (but for a tenant under its share of
        it: open_share.py), 400 for text that cannot be sent.
        While no JE is linked the submissions wait in the PUSH's pipe."""
        if not self.can_serve(model):
            raise APIError.unavailable("No engine is available to serve the request.")
        open_by = open_by_tenant(self._streams)
        if not admits(open_by, salt or "", len(samplings), self.config.max_open_requests):
            raise APIError.overloaded(sum(open_by.values()))
        ids = [f"{request_id}-{i}" for i in range(len(samplings))]
        submits = [SubmitRequest(
            request_id=rid, prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages,
            chat=chat, sampling=sampling, salt=salt, reply_to=self.config.reply_address, model=model,
            context_id=context_id, tenant=salt)
            for rid, sampling in zip(ids, samplings)]
        payloads = [self._encode(submit) for submit in submits]
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.config.max_queued_replies)
        stream = ReplyStream(ids, queue, self.config.request_timeout_s, self.abort, is_disconnected,
                             tenant=salt or "")
        self._streams.add(stream)
        for index, (rid, payload) in enumerate(zip(ids, payloads)):
            self._routes.add(Route(rid, stream, index, submits[index], je_epoch=self._je.epoch))
            if not self._je.send_or_hold(rid, payload):
                stream.close()
                raise APIError.unavailable("The job executor is not accepting requests.",
                                           "job_executor_busy")
        return stream

    def abort(self, request_id: str) -> None:
        """Forget the sub-request and tell the JE to abort it (if it is open)."""
        route = self._routes.pop(request_id)
        if route is None:
            return
        self._note_aborted(route.wire_id)  # its late deltas need no abort of their own
        abort = AbortRequest(request_id=route.wire_id)
        self._send(self._encoder.encode(abort))
        if route.je_epoch < self._je.epoch:  # its JE died: tell its TE directly
            self._abort_at_tes(abort)

    def _abort_orphan(self, wire_id: str) -> None:
        """Nobody here waits for wire_id (its gateway died, or its abort was
        lost): stop its TE generating for nobody, once per id."""
        if not self._note_aborted(wire_id):
            return
        abort = AbortRequest(request_id=wire_id)
        self._send(self._encoder.encode(abort))
        self._abort_at_tes(abort)

    def _note_aborted(self, wire_id: str) -> bool:
        """Remember wire_id as aborted (bounded, FIFO); False if it already was."""
        if wire_id in self._orphans:
            return False
        self._orphans[wire_id] = None
        if len(self._orphans) > MAX_ORPHANS:
            self._orphans.pop(next(iter(self._orphans)))
        return True

    def _abort_at_tes(self, abort: AbortRequest) -> None:
        """Best effort, never waits: every listed TE; one that lacks the id ignores it."""
        if self._te_outboxes is None:
            return
        for address in self.cluster.addresses:
            self._te_outboxes.put(address, abort)

    def _encode(self, msg) -> bytes:
        try:
            return self._encoder.encode(msg)
        except (UnicodeEncodeError, OverflowError, msgspec.EncodeError) as exc:
            raise APIError.bad_request(f"The request cannot be encoded: {exc}") from None

    def _send(self, payload: bytes) -> bool:
        """One message to the JE; with standby heads, one that finds no JE (a
        take-over under way) is not worth a warning: its sender copes."""
        return self._je.send(payload, quiet=self._je.to_heads)

    def _sending_held(self, request_id: str) -> bool:
        """A held submission goes now (je_link.py), if its request is still open."""
        route = self._routes.get(request_id)
        if route is not None:
            route.je_epoch = self._je.epoch
        return route is not None

    def _resume(self, route: Route) -> bool:
        """Resubmit a sub-request whose TE (or JE) was lost, from where its stream is."""
        resumed = next_attempt(route)
        if resumed is None:
            return False
        route.je_epoch = self._je.epoch
        logger.warning("resuming %s as %s (attempt %d) after %d tokens", route.request_id,
                       route.wire_id, route.attempt, len(route.token_ids))
        return self._je.send_or_hold(route.request_id, self._encoder.encode(resumed))

    def _on_new_je(self, epoch: int) -> None:
        """A JE is linked; resume what was sent to the incarnations before it
        (a context call sent to one that died is answered now: retry it)."""
        for call_id, (future, sent_to) in list(self._calls.items()):
            if sent_to < epoch and not future.done():
                future.set_result(RequestFailed(request_id=call_id, error="engine_dead",
                                                message="the job executor restarted"))
        for route in self._routes:
            if self._je.holds(route.request_id):  # never reached a JE: flushed later
                continue
            if route.je_epoch >= epoch:
                continue  # sent to this JE (it waited in the PUSH's pipe)
            orphan = AbortRequest(request_id=route.wire_id)
            self._abort_at_tes(orphan)  # the old attempt, if a TE still runs it
            self._send(self._encoder.encode(orphan))  # its submission, if still in the pipe
            self._routes.rewire(route, f"{route.request_id}.je{epoch}")
            if not self._resume(route):
                self._route_reply(RequestFailed(
                    request_id=route.wire_id, error="engine_dead",
                    message="The job executor restarted and the request could not be resumed."))

    def _deliver(self, route: Route, item) -> None:
        """Queue a reply for the route's stream; a full queue cuts the stream off."""
        try:
            route.queue.put_nowait((route.index, item))
        except asyncio.QueueFull:
            logger.warning("request %s: %d replies unread, its client is cut off",
                           route.request_id, route.queue.qsize())
            route.stream.cut_off()

    # -- views -----------------------------------------------------------------
    @property
    def can_route(self) -> bool:
        """A request sent now is routed: a JE is linked and the CM lists a TE."""
        return self._je.is_connected and (bool(self.te_ids)
                                          or bool(self.config.scalable_models))

    def can_serve(self, model: str | None) -> bool:
        """A TE of the model is listed, or the autoscaler starts one on demand."""
        if model is not None and model in self.config.scalable_models:
            return True
        if model is None or len(self.config.served_models) == 1:
            return bool(self.te_ids)  # one model: every TE serves it
        return bool(self.cluster.te_ids_of(model))

    @property
    def num_open_requests(self) -> int:
        """Sub-requests of streams not closed yet (admission; n counts n)."""
        return sum(open_by_tenant(self._streams).values())

    @property
    def num_running(self) -> int:
        return sum(route.is_started for route in self._routes)

    @property
    def num_waiting(self) -> int:
        return len(self._routes) - self.num_running

    def open_by_tenant(self) -> list[tuple[str | None, bool]]:
        """(tenant, started) of every open sub-request (/metrics)."""
        return [(route.submit.tenant, route.is_started) for route in self._routes]

    @property
    def te_ids(self) -> list[str]:
        return self.cluster.te_ids

    @property
    def reports(self) -> dict[str, TEReport]:
        return self.cluster.reports

    # -- receivers -------------------------------------------------------------
    async def _recv_replies(self) -> None:
        await _recv_forever(self._pull, ToClient, self._on_reply, "reply")

    def _on_reply(self, msg) -> None:
        call = self._calls.pop(getattr(msg, "request_id", None), None)
        if call is not None:  # a context call's answer (gateway/http/contexts.py)
            if not call[0].done():
                call[0].set_result(msg)
        elif isinstance(msg, (RequestDelta, RequestFailed)):
            self._route_reply(msg)  # no await: a reply is routed whole or not at all

    def _route_reply(self, msg: RequestDelta | RequestFailed) -> None:
        route = self._routes.reply_route(msg)
        if route is None:  # aborted, unknown, or an attempt a JE restart replaced
            if isinstance(msg, RequestDelta) and msg.finish_reason is None:
                self._abort_orphan(msg.request_id)
            return
        msg.request_id = route.request_id
        if isinstance(msg, RequestDelta):
            if msg.attempt != route.attempt:
                return  # a late delta of a lost attempt: its tokens are being redone
            if route.attempt and route.prompt_token_ids is not None:  # delivered already
                msg.prompt = msg.prompt_token_ids = msg.prompt_logprobs = None
            elif msg.prompt_token_ids is not None:
                route.prompt_token_ids = msg.prompt_token_ids
            route.token_ids.extend(msg.token_ids)
            route.num_text_chars += len(msg.text)
        elif msg.error in RETRYABLE_ERRORS and self._resume(route):
            return
        now = time.monotonic()
        if not route.is_started and self.metrics is not None:  # the JE's answer: per tenant
            self.metrics.observe_admission(route.submit.tenant, msg)
        route.is_started = True
        is_last = isinstance(msg, RequestFailed) or msg.finish_reason is not None
        if isinstance(msg, RequestDelta) and msg.token_ids:
            route.timing.first_token_at = route.timing.first_token_at or now
            route.timing.num_tokens += len(msg.token_ids)
        self._deliver(route, msg)
        if is_last and self._routes.pop(route.request_id) is not None:
            route.timing.finished_at = now
            if self.metrics is not None and isinstance(msg, RequestDelta):
                self.metrics.observe_request(route.timing)
            if isinstance(msg, RequestDelta):
                model = route.submit.model or self.config.served_model  # the autoscaler's SLOs
                self.notify(self._latencies.note(model, route.timing, now))
            if route.submit.messages is not None:  # token-id continuity: its turn, or none
                self.notify(TurnDone(request_id=route.submit.request_id,
                                     output_ids=reply_ids(msg, route)))

    def notify(self, msg) -> None:
        """A message to the JE that wants no answer (TurnDone, PinTurn, latencies)."""
        if msg is not None:
            self._send(self._encoder.encode(msg))

    async def call(self, msg, timeout_s: float):
        """Send a context message (CreateContext, ...) to the JE and await its
        answer (ContextInfo or RequestFailed); APIError 503 / 504 when none comes."""
        future = asyncio.get_running_loop().create_future()
        self._calls[msg.request_id] = (future, self._je.epoch)
        try:
            if not self._send(self._encode(msg)):
                raise APIError.unavailable("The job executor is not accepting requests.",
                                           "job_executor_busy")
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise APIError.timeout(timeout_s) from None
        finally:
            self._calls.pop(msg.request_id, None)

    async def _recv_cluster(self) -> None:
        await _recv_forever(self._sub, FromClusterManager, self.cluster.on_message, "cluster")


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
