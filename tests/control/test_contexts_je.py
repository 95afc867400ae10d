"""Contexts in the job executor over real sockets (je_rig.py): create (a
prefill task that pins), use, tenancy, delete, expiry, retries."""

import time

from deepserve.messages.cache import ContextUnpin
from deepserve.messages.contexts import ContextInfo, CreateContext, DeleteContext, GetContext
from deepserve.messages.engine import RequestDelta, RequestFailed, SubmitRequest
from deepserve.messages.sampling import SamplingParams
from tests.control.je_rig import _publish, _pump

MESSAGES = [{"role": "system", "content": "You review code. " * 20}]


def _te_task(rig):
    def got():
        for sock in rig["te"].values():
            try:
                return sock.get(timeout=0)
            except TimeoutError:
                pass
    return _pump(rig, got)


def _gw(rig):
    def got():
        try:
            return rig["gw"].get(timeout=0)
        except TimeoutError:
            return None
    return _pump(rig, got)


def _create(rig, salt="a", ttl_s=60.0, finish="length"):
    rig["to_je"].put(CreateContext(request_id="call-1", messages=MESSAGES, ttl_s=ttl_s,
                                   salt=salt, reply_to=rig["addr"]["gw"]))
    task = _te_task(rig)
    assert isinstance(task, SubmitRequest) and task.pin_context is not None
    rig["to_je"].put(RequestDelta(request_id=task.request_id, text="", token_ids=[1],
                                  finish_reason=finish))
    return task, _gw(rig)


def test_create_use_and_delete_a_context(rig):
    _publish(rig, ["te0"])
    task, info = _create(rig)
    assert task.sampling.max_tokens == 1 and task.reply_to == rig["addr"]["je"]
    assert task.pin_context.context_id == task.request_id == info.context_id
    text = rig["tok"].apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert task.prompt_token_ids == rig["tok"].encode(text, add_special_tokens=False)
    assert isinstance(info, ContextInfo) and info.num_tokens == len(task.prompt_token_ids)
    rig["to_je"].put(SubmitRequest(request_id="q", salt="a", context_id=info.context_id,
                                   messages=[{"role": "user", "content": "Is it fine?"}],
                                   sampling=SamplingParams(max_tokens=4),
                                   reply_to=rig["addr"]["gw"]))
    use = _te_task(rig)
    assert use.prompt_token_ids[:info.num_tokens] == task.prompt_token_ids
    assert use.context_id is None and use.pin_context is None
    rig["to_je"].put(DeleteContext(request_id="call-2", context_id=info.context_id,
                                   salt="a", reply_to=rig["addr"]["gw"]))
    assert _gw(rig).deleted is True
    assert isinstance(rig["kvc"].get(timeout=2), ContextUnpin)
    rig["to_je"].put(GetContext(request_id="call-3", context_id=info.context_id, salt="a",
                                reply_to=rig["addr"]["gw"]))
    assert _gw(rig).error == "context_not_found"


def test_another_tenant_never_finds_the_context(rig):
    _publish(rig, ["te0"])
    _, info = _create(rig, salt="a")
    for msg in (GetContext(request_id="g", context_id=info.context_id, salt="b",
                           reply_to=rig["addr"]["gw"]),
                SubmitRequest(request_id="s", salt="b", context_id=info.context_id,
                              prompt="x", sampling=SamplingParams(),
                              reply_to=rig["addr"]["gw"]),
                DeleteContext(request_id="d", context_id=info.context_id, salt="b",
                              reply_to=rig["addr"]["gw"])):
        rig["to_je"].put(msg)
        failed = _gw(rig)
        assert isinstance(failed, RequestFailed) and failed.error == "context_not_found"
    assert rig["je"].contexts.book.get(info.context_id, "a") is not None


def test_a_failed_prefill_is_retried_once_then_reported(rig):
    _publish(rig, ["te0"])
    rig["to_je"].put(CreateContext(request_id="c", prompt="x = 1\n" * 40, ttl_s=60.0,
                                   salt="a", reply_to=rig["addr"]["gw"]))
    first = _te_task(rig)
    rig["to_je"].put(RequestFailed(request_id=first.request_id, error="te_lost", message="x"))
    again = _te_task(rig)
    assert again.request_id == first.request_id
    rig["to_je"].put(RequestFailed(request_id=first.request_id, error="context_over_budget",
                                   message="full"))
    failed = _gw(rig)
    assert (failed.request_id, failed.error) == ("c", "context_over_budget")
    assert not rig["je"].contexts.book.contexts


def test_expired_contexts_are_gone_and_unpinned(rig):
    _publish(rig, ["te0"])
    _, info = _create(rig, ttl_s=1.0)
    time.sleep(1.1)
    unpin = _pump(rig, lambda: _recv_tier(rig))
    assert unpin.context_id == info.context_id
    assert rig["je"].contexts.book.get(info.context_id, "a") is None


def _recv_tier(rig):
    try:
        return rig["kvc"].get(timeout=0)
    except TimeoutError:
        return None


def test_bad_ttl_and_the_per_tenant_count_are_refused(rig):
    _publish(rig, ["te0"])
    rig["to_je"].put(CreateContext(request_id="t", prompt="x", ttl_s=0.5, salt="a",
                                   reply_to=rig["addr"]["gw"]))
    assert (_gw(rig).error, "ttl") == ("invalid_request", "ttl")
    rig["je"].contexts.book.max_per_tenant = 1
    _create(rig, salt="a")
    rig["to_je"].put(CreateContext(request_id="u", prompt="y", ttl_s=5, salt="a",
                                   reply_to=rig["addr"]["gw"]))
    assert _gw(rig).error == "too_many_contexts"


def test_a_creation_an_earlier_je_began_is_unpinned_when_its_answer_comes(rig):
    rig["to_je"].put(RequestDelta(request_id="ctx-" + "a" * 32, text="", token_ids=[1],
                                  finish_reason="length"))  # nobody here began it
    unpin = _pump(rig, lambda: _recv_tier(rig))
    assert unpin.context_id == "ctx-" + "a" * 32
