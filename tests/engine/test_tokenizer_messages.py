"""The tokenizer actor, in-process on real sockets: valid-but-bad messages
(unknown ids, a duplicate request id, token ids outside the vocabulary) are
answered or dropped, never fatal, and a request whose caller takes no reply
is aborted in the TE instead of generating on."""

from __future__ import annotations

import pytest

from deepserve.ipc.sockets import PullSocket, ipc_address
from deepserve.messages.engine import (AbortRequest, AddRequest, FinishRequest, NewTokens,
                                       RequestDelta, RequestFailed, StepTokens, SubmitRequest,
                                       ToClient)
from deepserve.messages.pd import FailRequest
from deepserve.messages.sampling import SamplingParams
from tests.engine.actor_harness import TokenizerHarness, drain

PARAMS = SamplingParams(max_tokens=8)


@pytest.fixture
def t(tiny_model, short_dir):
    harness = TokenizerHarness(str(tiny_model), short_dir)
    yield harness
    harness.close()


def _caller(t: TokenizerHarness, name: str) -> tuple[str, PullSocket]:
    address = ipc_address(t.addresses["inbox"].removeprefix("ipc://").rsplit("/", 1)[0], name)
    return address, PullSocket(t.ctx, address, bind=True, type=ToClient)


def test_a_duplicate_request_id_never_touches_the_live_request(t):
    a_addr, a = _caller(t, "a")
    b_addr, b = _caller(t, "b")
    try:
        t.send(SubmitRequest(request_id="r", prompt="hello", sampling=PARAMS, reply_to=a_addr))
        t.send(SubmitRequest(request_id="r", prompt="other", sampling=PARAMS, reply_to=b_addr))
        [dup] = drain(b)
        assert isinstance(dup, RequestFailed) and dup.param == "request_id"
        assert [type(m) for m in drain(t.master)] == [AddRequest]  # only the first
        t.send(StepTokens(items=[NewTokens("r", [5], "length")]))
        [delta] = drain(a)  # the live request's caller still gets its stream
        assert isinstance(delta, RequestDelta) and delta.finish_reason == "length"
        assert drain(t.client, 0.1) == []
    finally:
        a.close()
        b.close()


def test_unknown_ids_and_foreign_token_ids_are_dropped(t):
    t.send(StepTokens(items=[NewTokens("nobody", [5], "stop")]))
    t.send(AbortRequest(request_id="nobody"))
    t.send(FailRequest(request_id="nobody", error="x", message="y"))
    assert drain(t.master, 0.1) == [] and drain(t.client, 0.1) == []
    t.send(SubmitRequest(request_id="r", prompt="hello", sampling=PARAMS))
    t.send(StepTokens(items=[NewTokens("r", [-1]), NewTokens("r", [10 ** 12])]))
    assert drain(t.client, 0.1) == []  # dropped, the request lives on
    t.send(StepTokens(items=[NewTokens("r", [5], "length")]))
    [delta] = drain(t.client)
    assert delta.finish_reason == "length" and delta.token_ids == [5]
    assert t.actor.states == {}


@pytest.mark.parametrize("stalled", [False, True], ids=["refused-address", "stalled-caller"])
def test_a_caller_that_takes_no_reply_gets_its_request_aborted(t, stalled, monkeypatch):
    reply_to = "carrier-pigeon"  # an address ZeroMQ refuses: Outboxes drops, put() is False
    if stalled:  # a caller whose queue is full: Outboxes timed out on it once
        reply_to, sock = _caller(t, "stalled")
        sock.close()
        monkeypatch.setattr(t.actor.replies, "put",
                            lambda address, msg, probe=False: address != reply_to)
    t.send(SubmitRequest(request_id="r", prompt="hello", sampling=PARAMS, reply_to=reply_to))
    assert [type(m) for m in drain(t.master)] == [AddRequest]
    t.send(StepTokens(items=[NewTokens("r", [5])]))
    [finish] = drain(t.master)
    assert finish == FinishRequest(request_id="r", reason="abort")
    assert "r" not in t.actor.states and t.actor.num_undeliverable == 1
    t.send(StepTokens(items=[NewTokens("r", [6])]))  # steps already in flight: ignored
    assert drain(t.master, 0.1) == []


def test_the_tenant_goes_on_to_the_master(t):
    """The master's scheduler gives a light tenant a step of its own."""
    t.send(SubmitRequest(request_id="r", prompt="hello", sampling=PARAMS, tenant="B"))
    [add] = drain(t.master)
    assert isinstance(add, AddRequest) and add.tenant == "B"


def test_a_delta_with_logprobs_carries_the_bytes_of_every_token_they_name(t):
    """The gateway has no tokenizer: the bytes of the sampled token and of its
    alternatives come with the delta, and only when logprobs were asked for."""
    t.send(SubmitRequest(request_id="lp", prompt="hello", sampling=SamplingParams(
        max_tokens=8, logprobs=2)))
    t.send(SubmitRequest(request_id="plain", prompt="hello", sampling=PARAMS))
    logprobs = [(5, -0.1, [(5, -0.1), (7, -2.5)]), (6, -0.3, [(6, -0.3), (5, -1.0)])]
    t.send(StepTokens(items=[NewTokens("lp", [5, 6], logprobs=logprobs),
                             NewTokens("plain", [5, 6])]))
    deltas = {d.request_id: d for d in drain(t.client)}
    tokenizer = t.actor.tokenizer
    assert deltas["lp"].token_bytes == {i: tokenizer.token_bytes(i) for i in (5, 6, 7)}
    assert b"".join(deltas["lp"].token_bytes[i] for i in (5, 6)).decode() == \
        tokenizer.decode([5, 6])
    assert deltas["plain"].token_bytes is None
