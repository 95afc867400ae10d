"""OpenAI response objects built from RequestDeltas: whole responses and chunks.

A renderer knows one endpoint's shapes (chat or text completion). Tokens are
shown as "token_id:<id>": token text is not available at the gateway.
Completion logprobs give every token of a delta the text offset at which that
delta's text starts (token boundaries inside a delta are not known here).
A logprob is always a finite JSON number: -inf (a token the sampler masked)
and NaN are shown as LOGPROB_FLOOR, as OpenAI does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from deepserve.messages.engine import RequestDelta

LogprobEntry = tuple[int, float, list[tuple[int, float]]]
LOGPROB_FLOOR = -9999.0


def token_str(token_id: int) -> str:
    return f"token_id:{token_id}"


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
    num_chars: int = 0

    def add(self, delta: RequestDelta) -> None:
        for _ in delta.logprobs or ():
            self.offsets.append(self.num_chars)
        self.logprobs.extend(delta.logprobs or ())
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

    def __init__(self, response_id: str, model: str, with_logprobs: bool, include_usage: bool):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.with_logprobs = with_logprobs
        self.include_usage = include_usage
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
            logprobs = self._logprobs(delta.logprobs or [], [start] * len(delta.logprobs or ()))
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

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int]):
        raise NotImplementedError

    def _text_delta(self, text: str | None) -> dict:
        raise NotImplementedError

    def _final_choice(self, choice: Choice) -> dict:
        raise NotImplementedError


class ChatRenderer(Renderer):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}}, None, None)
                for i in range(num_choices)]

    def _text_delta(self, text: str | None) -> dict:
        return {"delta": {} if text is None else {"content": text}}

    def _final_choice(self, choice: Choice) -> dict:
        return {"index": choice.index,
                "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": self._logprobs(choice.logprobs, choice.offsets),
                "finish_reason": choice.finish_reason}

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int]) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"content": [
            {"token": token_str(token_id), "logprob": logprob_value(logprob), "bytes": None,
             "top_logprobs": [{"token": token_str(t), "logprob": logprob_value(lp),
                               "bytes": None} for t, lp in top]}
            for token_id, logprob, top in entries]}


class CompletionRenderer(Renderer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _text_delta(self, text: str | None) -> dict:
        return {"text": text or ""}

    def _final_choice(self, choice: Choice) -> dict:
        return {"index": choice.index, "text": "".join(choice.text),
                "logprobs": self._logprobs(choice.logprobs, choice.offsets),
                "finish_reason": choice.finish_reason}

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int]) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"tokens": [token_str(token_id) for token_id, _, _ in entries],
                "token_logprobs": [logprob_value(logprob) for _, logprob, _ in entries],
                "top_logprobs": [{token_str(t): logprob_value(lp) for t, lp in top}
                                 for _, _, top in entries],
                "text_offset": list(offsets)}
