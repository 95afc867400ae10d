"""One drill request's stream, checked as it arrives, and how it ended.

    HTTP response ──status != 200──> StreamFailure (the OpenAI error body, or http_error)
                  └─SSE data (sse.py)──> JSON chunk ──> RequestRecord
                                          ├─ {"error": ...}          StreamFailure
                                          ├─ logprob tokens "token_id:N" -> token_ids
                                          └─ finish_reason, usage, text

Token ids come from the logprob token strings, which the gateway renders as
"token_id:<id>" when a request sets vLLM's return_tokens_as_token_ids, as
every drill request does (gateway/http/responses.py): `logprobs.tokens` of a completion,
`logprobs.content[].token` of a chat completion. So a stream can be compared
token by token with its prompt's greedy reference (drill/report.py). With
n > 1 each choice's ids are kept apart (choice_ids, by choice index);
token_ids is all of them in arrival order (n = 1: the one choice's). A whole
(non-streamed) response folds in the same way (fold_response). Anything that
is not what the gateway sends (not JSON, not "token_id:N") is a protocol_error.

Times (start, first_token, end) are Unix epoch seconds (`now`, time.time()),
so they compare with the health log's ISO times.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from deepserve.drill.sse import aiter_sse_data

COMPLETED, FAILED, LOST = "completed", "failed", "lost"
TOKEN_PREFIX = "token_id:"
MAX_ERROR_BODY_BYTES = 64 * 1024

# error_type of failures the driver saw itself (the others are the server's OpenAI error type)
CONNECTION_ERROR = "connection_error"  # refused, reset, closed mid-stream
PROTOCOL_ERROR = "protocol_error"      # not SSE / JSON / "token_id:N" as the gateway sends
INCOMPLETE_STREAM = "incomplete_stream"  # ended cleanly but without a finish_reason
HTTP_ERROR = "http_error"              # non-200 without an OpenAI error body

now = time.time
"""The clock of every RequestRecord time (Unix epoch seconds)."""


@dataclass
class RequestRecord:
    """One request of a drill and how it ended.

    status: "completed" (a finish_reason, no error), "failed" (ended with an
    error the client saw: HTTP status != 200, an error event in the stream, a
    broken connection, a stream without finish), "lost" (no end before the
    driver's deadline; end stays None). For failed ones, error_type is the
    OpenAI error's type (e.g. "service_unavailable", "timeout") or one of the
    driver's own (connection_error, protocol_error, incomplete_stream,
    http_error), error its message.
    """

    id: int
    prompt_index: int
    max_tokens: int
    start: float
    first_token: float | None = None
    end: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    status: str | None = None
    error: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    http_status: int | None = None
    response_id: str | None = None
    usage: dict | None = None
    choice_ids: dict[int, list[int]] = field(default_factory=dict)
    """Token ids by choice index (n > 1: each choice on its own)."""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    """finish_reason by choice index."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def cached_tokens(self) -> int | None:
        """usage.prompt_tokens_details.cached_tokens, if the stream reported usage."""
        if not self.usage:
            return None
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")


class StreamFailure(Exception):
    """The request ended with an error the client saw."""

    def __init__(self, error_type: str, message: str, code: str | None = None):
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.code = code


async def read_stream(response, record: RequestRecord) -> None:
    """Fold one streaming /v1/completions response into `record`; raises
    StreamFailure for an HTTP error, an error event or a protocol error."""
    record.http_status = response.status_code
    if response.status_code != 200:
        raise await _http_failure(response)
    async for data in aiter_sse_data(response):
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise StreamFailure(PROTOCOL_ERROR, f"not JSON: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamFailure(PROTOCOL_ERROR, f"not a JSON object: {data[:200]!r}")
        if "error" in chunk:
            raise _error_failure(chunk)
        _add_chunk(record, chunk)


async def read_response(response, record: RequestRecord) -> None:
    """Fold one non-streamed JSON response into `record`; raises StreamFailure
    for an HTTP error or a body that is not what the gateway sends."""
    record.http_status = response.status_code
    if response.status_code != 200:
        raise await _http_failure(response)
    raw = b""
    async for part in response.aiter_bytes():
        raw += part
    try:
        body = json.loads(raw)
    except ValueError:
        raise StreamFailure(PROTOCOL_ERROR, f"not JSON: {raw[:200]!r}") from None
    fold_response(record, body)


def fold_response(record: RequestRecord, body) -> None:
    """Fold a whole (non-streamed) JSON response into `record`, as one chunk;
    raises StreamFailure for an error body or a protocol error."""
    if not isinstance(body, dict):
        raise StreamFailure(PROTOCOL_ERROR, f"not a JSON object: {str(body)[:200]!r}")
    if "error" in body:
        raise _error_failure(body)
    _add_chunk(record, body)


def _logprob_tokens(choice: dict) -> list:
    """The logprob token strings of a choice: a completion's `tokens`, or a chat
    completion's `content[].token`."""
    logprobs = choice.get("logprobs") or {}
    if not isinstance(logprobs, dict):
        raise StreamFailure(PROTOCOL_ERROR, f"logprobs is not an object: {logprobs!r:.200}")
    if logprobs.get("content") is not None:
        content = logprobs["content"]
        if not isinstance(content, list) or not all(isinstance(e, dict) for e in content):
            raise StreamFailure(PROTOCOL_ERROR, f"chat logprobs content: {content!r:.200}")
        return [e.get("token") for e in content]
    return logprobs.get("tokens") or []


def _choice_text(choice: dict) -> str:
    """A completion's text, a chat chunk's delta content or a chat message's content."""
    if choice.get("text"):
        return choice["text"]
    part = choice.get("delta") or choice.get("message") or {}
    return (part.get("content") or "") if isinstance(part, dict) else ""


def _add_chunk(record: RequestRecord, chunk: dict) -> None:
    record.response_id = record.response_id or chunk.get("id")
    if chunk.get("usage"):
        record.usage = chunk["usage"]
    for choice in chunk.get("choices") or ():
        tokens = _logprob_tokens(choice)
        try:
            ids = [int(t[len(TOKEN_PREFIX):]) for t in tokens if t.startswith(TOKEN_PREFIX)]
        except (TypeError, ValueError, AttributeError):
            ids = None
        if ids is None or len(ids) != len(tokens):
            raise StreamFailure(PROTOCOL_ERROR, f"logprob tokens are not {TOKEN_PREFIX}N: "
                                                f"{tokens[:5]!r}")
        text = _choice_text(choice)
        if (ids or text) and record.first_token is None:
            record.first_token = now()
        index = choice.get("index") or 0
        record.token_ids.extend(ids)
        record.choice_ids.setdefault(index, []).extend(ids)
        record.text += text
        if choice.get("finish_reason") is not None:
            record.finish_reason = choice["finish_reason"]
            record.finish_reasons[index] = choice["finish_reason"]


def _error_failure(body) -> StreamFailure:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return StreamFailure(str(error.get("type") or "error"), str(error.get("message") or ""),
                             error.get("code"))
    return StreamFailure("error", str(error))


async def _http_failure(response) -> StreamFailure:
    raw = b""
    async for part in response.aiter_bytes():
        raw += part
        if len(raw) >= MAX_ERROR_BODY_BYTES:
            break
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return _error_failure(body)
    text = raw[:200].decode(errors="replace")
    return StreamFailure(HTTP_ERROR, f"HTTP {response.status_code}: {text}")


def first_success_after(records: list[RequestRecord], t: float) -> float | None:
    """The earliest first-token time of a completed request that started after
    `t` (epoch seconds; a completed request without tokens counts by its end
    time); None if there is none. The drill's "recovered at"."""
    times = [r.first_token if r.first_token is not None else r.end
             for r in records if r.status == COMPLETED and r.start > t]
    times = [x for x in times if x is not None]
    return min(times, default=None)
