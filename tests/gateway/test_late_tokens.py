"""Late tokens (gateway/link/routes.py): a delta of an attempt its route left
behind (an older attempt number, or a wire id a JE change replaced) is counted
in /metrics, its tokens each and its sub-request once, and never delivered."""

from __future__ import annotations

import asyncio

from deepserve.gateway.link.reply_stream import ReplyStream
from deepserve.gateway.link.routes import Route, RouteTable
from deepserve.gateway.metrics import GatewayMetrics
from deepserve.messages.engine import RequestDelta, RequestFailed, SamplingParams, SubmitRequest


def _route(request_id: str) -> Route:
    stream = ReplyStream([request_id], asyncio.Queue(), 5.0, lambda _: None, None)
    submit = SubmitRequest(request_id=request_id, prompt_token_ids=[1, 2],
                           sampling=SamplingParams(max_tokens=8))
    return Route(request_id, stream, 0, submit)


def _counts(metrics: GatewayMetrics) -> tuple[float, float]:
    return (metrics.registry.get_sample_value("deepserve_gateway_late_tokens_total"),
            metrics.registry.get_sample_value("deepserve_gateway_late_requests_total"))


def _delta(wire_id: str, attempt: int, n: int) -> RequestDelta:
    return RequestDelta(request_id=wire_id, text="x" * n, token_ids=list(range(n)),
                        attempt=attempt)


def test_tokens_of_a_left_attempt_are_counted_once_per_request():
    metrics = GatewayMetrics()
    table = RouteTable(metrics)
    a, b = _route("a"), _route("b")
    table.add(a)
    table.add(b)
    assert table.reply_route(_delta("a", 0, 3)) is a and _counts(metrics) == (0, 0)
    a.attempt = 1  # resumed on another TE
    assert table.reply_route(_delta("a", 1, 2)) is a and _counts(metrics) == (0, 0)
    assert table.reply_route(_delta("a", 0, 4)) is a  # the old attempt still ran
    assert _counts(metrics) == (4, 1)
    table.rewire(a, "a.je1")  # the JE changed: the old wire id is left behind
    assert table.reply_route(_delta("a", 1, 2)) is None
    assert _counts(metrics) == (6, 1)  # the same request: counted once
    assert table.reply_route(RequestFailed(request_id="a", error="te_lost", message="lost")) is None
    assert table.reply_route(_delta("b", 0, 5)) is b and _counts(metrics) == (6, 1)
    assert table.reply_route(_delta("nobody", 0, 5)) is None and _counts(metrics) == (6, 1)
    assert table.pop("a") is a  # closed: its old wire id is forgotten
    assert table.reply_route(_delta("a", 1, 2)) is None and _counts(metrics) == (6, 1)
    assert not table._replaced


def test_without_metrics_nothing_is_counted_and_routing_is_unchanged():
    table = RouteTable()
    a = _route("a")
    table.add(a)
    a.attempt = 1
    assert table.reply_route(_delta("a", 0, 4)) is a and not a.had_late_tokens
