"""OpenAI response objects built from RequestDeltas: whole responses and chunks.

A renderer knows one endpoint's shapes (chat or text completion).

Logprobs name tokens by their text: the TE, which detokenizes anyway, sends
the exact bytes of every token its logprobs name (RequestDelta.token_bytes),
so no tokenizer runs here per token. A token's string is its bytes decoded
as UTF-8 with U+FFFD for a partial character (as vLLM decodes one token);
chat's `bytes` are the token's own bytes, as OpenAI gives them (vLLM gives
the bytes of that string). A token whose bytes did not come, or every token
when the request set return_tokens_as_token_ids (vLLM's field), is shown as
"token_id:<id>". Completion logprobs' text_offset is per token when a
delta's text is exactly its tokens' bytes decoded (a token that starts
inside a character gets that character's offset); else (text held back for
a stop string, a character split across deltas) every token of the delta
gets the offset at which the delta's text starts. A logprob is always a
finite JSON number: -inf (a token the sampler masked) and NaN are shown as
LOGPROB_FLOOR, as OpenAI does.
"""

from __future__ import annotations

import codecs
import math
import time
from dataclasses import dataclass, field

from deepserve.messages.engine import RequestDelta

LogprobEntry = tuple[int, float, list[tuple[int, float]]]
LOGPROB_FLOOR = -9999.0


def token_str(token_id: int) -> str:
    return f"token_id:{token_id}"


def token_text(token_id: int, token_bytes: dict[int, bytes] | None,
               as_ids: bool = False) -> tuple[str, list[int] | None]:
    """(how a token is shown, its bytes or None when they are not known)."""
    raw = token_bytes.get(token_id) if token_bytes else None
    if raw is None:
        return token_str(token_id), None
    return (token_str(token_id) if as_ids else raw.decode("utf-8", "replace")), list(raw)


def text_offsets(delta: RequestDelta, start: int) -> list[int]:
    """The text offset of each token of a delta's logprobs (module doc)."""
    entries = delta.logprobs or ()
    pieces = [(delta.token_bytes or {}).get(token_id) for token_id, _, _ in entries]
    if None in pieces or len(entries) < 2:
        return [start] * len(entries)
    try:
        if b"".join(pieces).decode() != delta.text:
            return [start] * len(entries)
    except UnicodeDecodeError:
        return [start] * len(entries)
    decoder, offsets, pos = codecs.getincrementaldecoder("utf-8")(), [], start
    for piece in pieces:
        offsets.append(pos)
        pos += len(decoder.decode(piece))
    return offsets


def logprob_value(logprob: float) -> float:
    """A logprob JSON can carry: -inf, NaN and anything below the floor -> the floor."""
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class Choice:
    """What one sub-request produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    token_bytes: dict[int, bytes] = field(default_factory=dict)
    num_chars: int = 0

    def add(self, delta: RequestDelta) -> None:
        self.offsets.extend(text_offsets(delta, self.num_chars))
        self.logprobs.extend(delta.logprobs or ())
        self.token_bytes.update(delta.token_bytes or {})
        self.text.append(delta.text)
        self.num_chars += len(delta.text)
        self.finish_reason = delta.finish_reason or self.finish_reason


class Usage:
    """Token counts of the sub-requests of one request; the prompt counts once."""

    def __init__(self, num_choices: int):
        self.prompt_tokens = [0] * num_choices
        self.cached_tokens = [0] * num_choices
        self.completion_tokens = [0] * num_choices

    def add(self, index: int, delta: RequestDelta) -> None:
        if delta.prompt_token_ids is not None:
            self.prompt_tokens[index] = len(delta.prompt_token_ids)
            self.cached_tokens[index] = delta.cached_tokens
        self.completion_tokens[index] += len(delta.token_ids)

    def body(self) -> dict:
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": self.prompt_tokens[0], "completion_tokens": completion,
                "total_tokens": self.prompt_tokens[0] + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens[0]}}


class Renderer:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, with_logprobs: bool, include_usage: bool,
                 tokens_as_ids: bool = False):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.with_logprobs = with_logprobs
        self.include_usage = include_usage
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids
        self._num_chars: dict[int, int] = {}

    def response(self, choices: list[Choice], usage: Usage) -> dict:
        return {**self._header(self.object_name),
                "choices": [self._final_choice(c) for c in choices], "usage": usage.body()}

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return []

    def delta_chunks(self, index: int, delta: RequestDelta) -> list[dict]:
        """The chunks one delta becomes: its text (if any), then its finish."""
        chunks = []
        start = self._num_chars.get(index, 0)
        self._num_chars[index] = start + len(delta.text)
        if delta.text or (self.with_logprobs and delta.logprobs):
            logprobs = self._logprobs(delta.logprobs or [], text_offsets(delta, start),
                                      delta.token_bytes)
            chunks.append(self._chunk(index, self._text_delta(delta.text), logprobs, None))
        if delta.finish_reason is not None:
            chunks.append(self._chunk(index, self._text_delta(None), None, delta.finish_reason))
        return chunks

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._header(self.chunk_object_name), "choices": [], "usage": usage.body()}

    def _header(self, object_name: str) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model}

    def _chunk(self, index: int, payload: dict, logprobs, finish_reason) -> dict:
        chunk = {**self._header(self.chunk_object_name),
                 "choices": [{"index": index, **payload, "logprobs": logprobs,
                              "finish_reason": finish_reason}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int],
                  token_bytes: dict[int, bytes] | None):
        raise NotImplementedError

    def _token(self, token_id: int, token_bytes: dict[int, bytes] | None
               ) -> tuple[str, list[int] | None]:
        return token_text(token_id, token_bytes, self.tokens_as_ids)

    def _text_delta(self, text: str | None) -> dict:
        raise NotImplementedError

    def _final_choice(self, choice: Choice) -> dict:
        raise NotImplementedError


class ChatRenderer(Renderer):
    """tools: the request's ToolPlan (tool_use.py), None without tools: the
    output is read into tool_calls, whole or as streamed deltas."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tools=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = tools
        self._streamers: dict[int, object] = {}  # choice index -> its tool-call stream

    def delta_chunks(self, index: int, delta: RequestDelta) -> list[dict]:
        if self.tools is None:
            return super().delta_chunks(index, delta)
        streamer = self._streamers.setdefault(index, self.tools.streamer())
        events = streamer.feed(delta.text)
        if delta.finish_reason is not None:
            events += streamer.finish()
        payloads = [{"delta": {"content": e}} if isinstance(e, str)
                    else {"delta": {"tool_calls": [e]}} for e in events if e != ""]
        logprobs = None
        if self.with_logprobs and delta.logprobs:
            start = self._num_chars.get(index, 0)
            logprobs = self._logprobs(delta.logprobs, text_offsets(delta, start),
                                      delta.token_bytes)
            payloads = payloads or [{"delta": {}}]
        self._num_chars[index] = self._num_chars.get(index, 0) + len(delta.text)
        chunks = [self._chunk(index, p, logprobs if i == 0 else None, None)
                  for i, p in enumerate(payloads)]
        if delta.finish_reason is not None:
            reason = self.tools.finish_reason(delta.finish_reason, streamer.num_calls)
            chunks.append(self._chunk(index, {"delta": {}}, None, reason))
        return chunks

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}}, None, None)
                for i in range(num_choices)]

    def _text_delta(self, text: str | None) -> dict:
        return {"delta": {} if text is None else {"content": text}}

    def _final_choice(self, choice: Choice) -> dict:
        message = {"role": "assistant", "content": "".join(choice.text)}
        finish_reason = choice.finish_reason
        if self.tools is not None:
            content, calls = self.tools.final(message["content"])
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish_reason = self.tools.finish_reason(finish_reason, len(calls))
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(choice.logprobs, choice.offsets, choice.token_bytes),
                "finish_reason": finish_reason}

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int],
                  token_bytes: dict[int, bytes] | None) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"content": [
            {**self._entry(token_id, logprob, token_bytes),
             "top_logprobs": [self._entry(t, lp, token_bytes) for t, lp in top]}
            for token_id, logprob, top in entries]}

    def _entry(self, token_id: int, logprob: float, token_bytes: dict[int, bytes] | None) -> dict:
        text, raw = self._token(token_id, token_bytes)
        return {"token": text, "logprob": logprob_value(logprob), "bytes": raw}


class CompletionRenderer(Renderer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _text_delta(self, text: str | None) -> dict:
        return {"text": text or ""}

    def _final_choice(self, choice: Choice) -> dict:
        return {"index": choice.index, "text": "".join(choice.text),
                "logprobs": self._logprobs(choice.logprobs, choice.offsets, choice.token_bytes),
                "finish_reason": choice.finish_reason}

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int],
                  token_bytes: dict[int, bytes] | None) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"tokens": [self._token(token_id, token_bytes)[0] for token_id, _, _ in entries],
                "token_logprobs": [logprob_value(logprob) for _, logprob, _ in entries],
                "top_logprobs": [{self._token(t, token_bytes)[0]: logprob_value(lp)
                                  for t, lp in top} for _, _, top in entries],
                "text_offset": list(offsets)}
