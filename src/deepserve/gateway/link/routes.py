"""Routes: the gateway's open sub-requests, and how one resumes where its stream is.

A route lives from submit until its sub-request's last reply or its abort. It
has two names: the request id the HTTP side knows (`{response id}-{i}`) and
the wire id the JE and TEs know it by. They are equal until a JE restart
resubmits the sub-request under `{request id}.je{epoch}` (job_client.py), so
that whatever the orphaned attempt still sends is not taken for the new one's.

Late tokens: a delta of an attempt that is no longer the route's (an earlier
attempt number, or a wire id a JE change replaced) carries tokens some TE
generated for nothing, since the current attempt generates them again. The
table counts them, and once per route the sub-request they belong to, in
/metrics (deepserve_gateway_late_tokens_total, ..._late_requests_total): a
request generated on two TEs at once, what a split brain would show.

next_attempt(route) is the resubmission after its TE (or its JE) was lost:
prompt = the prompt's token ids + every output token already streamed,
max_tokens reduced by as many (an unset one stays unset: the TE counts
`resumed_output_ids` against the model's max_new_tokens, and the rest of
the context shrinks by itself), `resumed_output_ids` = those tokens and
`resumed_text_chars` = the characters (code points) of their text already
passed on to the caller. The TE detokenizes from those ids and streams only
the text past that point, so the caller's text has no gap and no repeat even
when the lost TE held characters back (a stop-string prefix, an incomplete
UTF-8 sequence) at the moment it died. min_tokens shrinks by the tokens
streamed too, and prompt_logprobs are not asked again (they came with the
first delta; the new prompt would add the output's). A grammar continues:
the TE tells the workers to replay the resumed tokens into it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Iterator

import msgspec

from deepserve.gateway.metrics import GatewayMetrics, RequestTiming
from deepserve.gateway.link.reply_stream import ReplyStream
from deepserve.messages.engine import RequestDelta, RequestFailed, SubmitRequest


@dataclass
class Route:
    request_id: str
    stream: ReplyStream
    index: int  # of the sub-request in its stream (the choice index)
    submit: SubmitRequest  # the first attempt's
    je_epoch: int = 0  # the JE incarnation it was last sent to (je_link.py)
    wire_id: str = ""  # the id the JE and TEs know it by; "" until added: request_id
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(time.monotonic()))
    is_started: bool = False
    prompt_token_ids: list[int] | None = None  # from the first delta
    token_ids: list[int] = field(default_factory=list)  # output streamed so far
    num_text_chars: int = 0  # characters of output text passed on to the stream
    attempt: int = 0
    had_late_tokens: bool = False  # an attempt it left behind sent tokens (RouteTable)

    @property
    def queue(self) -> asyncio.Queue:
        return self.stream.queue


def next_attempt(route: Route) -> SubmitRequest | None:
    """The route's next attempt (route.attempt advanced), or None when
    nothing is left to generate or the stream's start is unknown."""
    first = route.submit
    if route.token_ids and route.prompt_token_ids is None:
        return None  # cannot happen: the first delta carries the prompt ids
    max_tokens = first.sampling.max_tokens
    if max_tokens is not None:
        max_tokens -= len(route.token_ids)
        if max_tokens < 1:
            return None
    route.attempt += 1
    if route.prompt_token_ids is None:  # nothing streamed: the same request again
        return msgspec.structs.replace(first, request_id=route.wire_id, attempt=route.attempt)
    return msgspec.structs.replace(
        first, request_id=route.wire_id, prompt=None, messages=None, attempt=route.attempt,
        context_id=None,  # the prompt ids below begin with the context's
        sampling=msgspec.structs.replace(  # the prompt's logprobs came with the first delta
            first.sampling, max_tokens=max_tokens, prompt_logprobs=None,
            min_tokens=max(0, first.sampling.min_tokens - len(route.token_ids))),
        prompt_token_ids=route.prompt_token_ids + route.token_ids,
        resumed_output_ids=len(route.token_ids), resumed_text_chars=route.num_text_chars)


class RouteTable:
    """Open routes by request id and by wire id (always both or neither)."""

    def __init__(self, metrics: GatewayMetrics | None = None):
        self._by_id: dict[str, Route] = {}
        self._by_wire: dict[str, Route] = {}
        self._replaced: dict[str, Route] = {}  # wire ids a rewire left behind, while open
        self.metrics = metrics

    def add(self, route: Route) -> None:
        route.wire_id = route.wire_id or route.request_id
        self._by_id[route.request_id] = route
        self._by_wire[route.wire_id] = route

    def get(self, request_id: str) -> Route | None:
        return self._by_id.get(request_id)

    def by_wire(self, wire_id: str) -> Route | None:
        return self._by_wire.get(wire_id)

    def reply_route(self, reply: RequestDelta | RequestFailed) -> Route | None:
        """by_wire(reply's id); a delta of an attempt the route left behind counts
        its tokens as late (the module's docstring)."""
        route = self._by_wire.get(reply.request_id)
        late = self._replaced.get(reply.request_id) if route is None else route
        if (isinstance(reply, RequestDelta) and reply.token_ids and late is not None
                and (route is None or reply.attempt != route.attempt)):
            self._count_late(late, len(reply.token_ids))
        return route

    def _count_late(self, route: Route, num_tokens: int) -> None:
        if self.metrics is None:
            return
        self.metrics.late_tokens.inc(num_tokens)
        if not route.had_late_tokens:
            route.had_late_tokens = True
            self.metrics.late_requests.inc()

    def pop(self, request_id: str) -> Route | None:
        route = self._by_id.pop(request_id, None)
        if route is not None:
            del self._by_wire[route.wire_id]
            for wire_id in [w for w, r in self._replaced.items() if r is route]:
                del self._replaced[wire_id]
        return route

    def rewire(self, route: Route, wire_id: str) -> None:
        """Known from now on by `wire_id`; replies to the old one are dropped."""
        del self._by_wire[route.wire_id]
        self._replaced[route.wire_id] = route
        route.wire_id = wire_id
        self._by_wire[wire_id] = route

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Route]:
        return iter(list(self._by_id.values()))


def reply_ids(last, route: Route) -> list[int] | None:
    """What a chat sub-request's TurnDone carries (token-id continuity, the JE's
    turns.py): its output ids when it completed (stop or length); None when it
    failed, so the JE forgets its prompt at once rather than at MAX_PENDING."""
    if isinstance(last, RequestDelta) and last.finish_reason in ("stop", "length"):
        return route.token_ids
    return None
