"""stream.py beyond completions: chat logprobs, n > 1 choices kept apart,
whole (non-streamed) responses; report.ids_reason."""

from __future__ import annotations

import pytest

from deepserve.drill.report import ids_reason
from deepserve.drill.stream import (PROTOCOL_ERROR, RequestRecord, StreamFailure, _add_chunk,
                                    fold_response)


def _record() -> RequestRecord:
    return RequestRecord(id=0, prompt_index=0, max_tokens=4, start=0.0)


def _chat_chunk(index, ids, finish=None):
    return {"id": "chatcmpl-1", "choices": [{
        "index": index, "delta": {"content": "".join(f"w{i}" for i in ids)},
        "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": -0.1} for i in ids]},
        "finish_reason": finish}]}


def test_chat_chunks_of_two_choices_stay_apart():
    r = _record()
    for chunk in (_chat_chunk(0, [1, 2]), _chat_chunk(1, [1]), _chat_chunk(1, [2], "length"),
                  _chat_chunk(0, [], "length")):
        _add_chunk(r, chunk)
    assert r.choice_ids == {0: [1, 2], 1: [1, 2]} and r.token_ids == [1, 2, 1, 2]
    assert r.finish_reasons == {0: "length", 1: "length"} and r.response_id == "chatcmpl-1"
    assert r.text == "w1w2w1w2" and r.first_token is not None


def test_fold_whole_responses():
    r = _record()
    fold_response(r, {"id": "cmpl-1", "usage": {"completion_tokens": 2}, "choices": [
        {"index": 0, "text": "ab", "finish_reason": "stop",
         "logprobs": {"tokens": ["token_id:7", "token_id:8"]}}]})
    assert r.choice_ids == {0: [7, 8]} and r.finish_reason == "stop" and r.text == "ab"
    chat = _record()
    fold_response(chat, {"id": "c", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length",
         "logprobs": {"content": [{"token": "token_id:3"}]}}]})
    assert chat.choice_ids == {0: [3]} and chat.text == "x"
    with pytest.raises(StreamFailure) as err:
        fold_response(_record(), {"error": {"type": "invalid_request_error", "message": "no"}})
    assert err.value.error_type == "invalid_request_error"
    with pytest.raises(StreamFailure) as err:
        fold_response(_record(), {"choices": [{"logprobs": {"content": [{"token": "x"}]}}]})
    assert err.value.error_type == PROTOCOL_ERROR
    with pytest.raises(StreamFailure):
        fold_response(_record(), [1, 2])


def test_ids_reason():
    ref = [1, 2, 3, 4, 5]
    assert ids_reason([1, 2, 3, 4], ref, 4, completed=True) is None
    assert ids_reason([1, 2], ref, 4, completed=False) is None  # a failed prefix is fine
    assert "completed with 2" in ids_reason([1, 2], ref, 4, completed=True)
    assert "token 2 is 2" in ids_reason([1, 2, 2, 3], ref, 4, completed=True)  # repeated
    assert "5 tokens" in ids_reason([1, 2, 3, 4, 5], ref, 4, completed=False)
