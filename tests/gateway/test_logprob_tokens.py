"""Logprobs as OpenAI shows them, from the bytes the TE sends with each delta
(RequestDelta.token_bytes): token strings, chat `bytes`, per-token
text_offset, and "token_id:<id>" where the bytes are missing or asked for."""

from __future__ import annotations

from deepserve.gateway.http.chat_response import ChatRenderer
from deepserve.gateway.http.responses import (Choice, CompletionRenderer, Usage, text_offsets,
                                              token_text)
from deepserve.messages.engine import RequestDelta

E_ACUTE = "é".encode()  # b"\xc3\xa9": two tokens below, one character


def _delta(text: str, pieces: dict[int, bytes], ids: list[int], **kwargs) -> RequestDelta:
    logprobs = [(i, -0.5, [(i, -0.5), (99, float("-inf"))]) for i in ids]
    return RequestDelta(request_id="r", text=text, token_ids=ids, logprobs=logprobs,
                        token_bytes={**pieces, 99: b" x"}, **kwargs)


def test_token_text_is_its_bytes_decoded_or_its_id():
    assert token_text(5, {5: b" hi"}) == (" hi", [32, 104, 105])
    assert token_text(5, {5: E_ACUTE[:1]}) == ("\ufffd", [0xC3])  # a partial character
    assert token_text(5, {5: b" hi"}, as_ids=True) == ("token_id:5", [32, 104, 105])
    assert token_text(5, {}) == token_text(5, None) == ("token_id:5", None)


def test_text_offsets_per_token_when_the_text_is_the_tokens():
    delta = _delta("héllo", {1: b"h", 2: E_ACUTE[:1], 3: E_ACUTE[1:] + b"l", 4: b"lo"},
                   [1, 2, 3, 4])
    # the token that starts inside "é" gets the character's offset
    assert text_offsets(delta, 10) == [10, 11, 11, 13]


def test_text_offsets_fall_back_to_the_deltas_start():
    held = _delta("he", {1: b"h", 2: b"ey"}, [1, 2])  # "y" held back (a stop string's start)
    assert text_offsets(held, 7) == [7, 7]
    partial = _delta("", {1: b"a", 2: E_ACUTE[:1]}, [1, 2])  # "a" waits for the character
    assert text_offsets(partial, 3) == [3, 3]
    missing = RequestDelta(request_id="r", text="ab", token_ids=[1, 2],
                           logprobs=[(1, -1.0, []), (2, -1.0, [])])
    assert text_offsets(missing, 0) == [0, 0]


def test_chat_logprobs_carry_token_strings_and_bytes():
    renderer = ChatRenderer("id", "m", with_logprobs=True, include_usage=False)
    choice = Choice(0)
    choice.add(_delta("hé", {1: b"h", 2: E_ACUTE[:1]}, [1, 2]))
    choice.add(_delta("", {3: E_ACUTE[1:]}, [3], finish_reason="stop"))
    content = renderer.response([choice], Usage(1))["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [
        ("h", [0x68]), ("\ufffd", [0xC3]), ("\ufffd", [0xA9])]
    assert content[0]["top_logprobs"] == [{"token": "h", "logprob": -0.5, "bytes": [0x68]},
                                          {"token": " x", "logprob": -9999.0,
                                           "bytes": [32, 120]}]


def test_completion_chunks_and_token_ids():
    renderer = CompletionRenderer("id", "m", True, False)
    [chunk] = renderer.delta_chunks(0, _delta("ab", {1: b"a", 2: b"b"}, [1, 2]))
    [second] = renderer.delta_chunks(0, _delta("c", {3: b"c"}, [3]))
    assert chunk["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"], "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"a": -0.5, " x": -9999.0}, {"b": -0.5, " x": -9999.0}],
        "text_offset": [0, 1]}
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    as_ids = CompletionRenderer("id", "m", True, False, tokens_as_ids=True)
    [chunk] = as_ids.delta_chunks(0, _delta("ab", {1: b"a", 2: b"b"}, [1, 2]))
    logprobs = chunk["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:1", "token_id:2"]
    assert logprobs["top_logprobs"][0] == {"token_id:1": -0.5, "token_id:99": -9999.0}
