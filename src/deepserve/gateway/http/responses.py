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


def logprob_value(logprob: float | None) -> float | None:
    """A logprob JSON can carry: -inf, NaN and anything below the floor -> the
    floor; None (the first prompt token's) stays null."""
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def prompt_entries(delta: RequestDelta) -> list:
    """(id, logprob, top) of every prompt token: the first has none (None)."""
    return [(delta.prompt_token_ids[0], None, None), *delta.prompt_logprobs]


def prompt_logprobs_body(entries: list, token_bytes: dict[int, bytes]) -> list:
    """vLLM's prompt_logprobs: None, then per token {id: {logprob, rank,
    decoded_token}} for the token and its alternatives; rank is its place
    among the alternatives (1 = most likely), null when not among them."""
    body: list = []
    for token_id, logprob, top in entries:
        if logprob is None:
            body.append(None)
            continue
        ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
        pairs = [(token_id, logprob), *((t, lp) for t, lp in top if t != token_id)]
        body.append({str(t): {"logprob": logprob_value(lp), "rank": ranks.get(t),
                              "decoded_token": token_text(t, token_bytes)[0]}
                     for t, lp in pairs})
    return body


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
    prompt_entries: list = field(default_factory=list)
    """With prompt logprobs: each prompt token's entry, the first one's None."""

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_logprobs is not None and delta.prompt_token_ids:
            self.prompt_entries = prompt_entries(delta)
        self.offsets.extend(text_offsets(delta, self.num_chars))
        self.logprobs.extend(delta.logprobs or ())
        self.token_bytes.update(delta.token_bytes or {})
        self.text.append(delta.text)
        self.num_chars += len(delta.text)
        self.finish_reason = delta.finish_reason or self.finish_reason


class Usage:
    """Token counts of the sub-requests of one request; each prompt counts
    once (choices_per_prompt choices share one: a list of prompts has several)."""

    def __init__(self, num_choices: int, choices_per_prompt: int | None = None):
        self.per_prompt = choices_per_prompt or num_choices
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
        prompt = sum(self.prompt_tokens[::self.per_prompt])
        cached = sum(self.cached_tokens[::self.per_prompt])
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


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


class CompletionRenderer(Renderer):
    """echo: the prompt's text, put before the output (and, with logprobs,
    the prompt's tokens before the output's); None: no echo.
    with_prompt_logprobs: each choice carries vLLM's prompt_logprobs."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, echo: list[str] | None = None, choices_per_prompt: int = 1,
                 with_prompt_logprobs: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo, self.with_prompt_logprobs = echo, with_prompt_logprobs
        self.per_prompt = choices_per_prompt

    def _echo_of(self, index: int) -> str | None:
        return None if self.echo is None else self.echo[index // self.per_prompt]

    def delta_chunks(self, index: int, delta: RequestDelta) -> list[dict]:
        chunks = []
        echo = self._echo_of(index)
        if echo is not None and delta.prompt_token_ids is not None:
            entries = prompt_entries(delta) if delta.prompt_logprobs is not None else []
            logprobs = self._logprobs(entries, prompt_offsets(entries, delta.token_bytes),
                                      delta.token_bytes) if entries else None
            chunks.append(self._chunk(index, {"text": echo}, logprobs, None))
            self._num_chars[index] = len(echo)
        return chunks + super().delta_chunks(index, delta)

    def _text_delta(self, text: str | None) -> dict:
        return {"text": text or ""}

    def _final_choice(self, choice: Choice) -> dict:
        entries, offsets, text = choice.logprobs, choice.offsets, "".join(choice.text)
        echo = self._echo_of(choice.index)
        if echo is not None:
            shift = len(echo)
            entries = [*choice.prompt_entries, *entries]
            offsets = [*prompt_offsets(choice.prompt_entries, choice.token_bytes),
                       *(o + shift for o in offsets)]
            text = echo + text
        body = {"index": choice.index, "text": text,
                "logprobs": self._logprobs(entries, offsets, choice.token_bytes),
                "finish_reason": choice.finish_reason}
        if self.with_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_body(choice.prompt_entries,
                                                           choice.token_bytes)
        return body

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int],
                  token_bytes: dict[int, bytes] | None) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"tokens": [self._token(token_id, token_bytes)[0] for token_id, _, _ in entries],
                "token_logprobs": [logprob_value(logprob) for _, logprob, _ in entries],
                "top_logprobs": [None if top is None else
                                 {self._token(t, token_bytes)[0]: logprob_value(lp)
                                  for t, lp in top} for _, _, top in entries],
                "text_offset": list(offsets)}


def prompt_offsets(entries: list, token_bytes: dict[int, bytes] | None) -> list[int]:
    """Each prompt token's offset in the echoed text: the lengths of the
    tokens' strings before it."""
    offsets, pos = [], 0
    for token_id, _, _ in entries:
        offsets.append(pos)
        pos += len(token_text(token_id, token_bytes)[0])
    return offsets
