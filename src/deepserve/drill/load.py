"""Load for fault-injection drills: streaming /v1/completions, every request accounted.

    LoadDriver ── `concurrency` workers, each: POST /v1/completions (stream, logprobs 1,
                  temperature 0) ──SSE──> RequestRecord (token ids, text, finish, error)
               └─ reference(): each prompt once, sequentially, before any fault

Token ids come from the logprob token strings, which the gateway renders as
"token_id:<id>" (gateway/responses.py), so a stream can be compared token by
token with its prompt's greedy reference (drill/report.py).

Every request is bounded by the driver itself: `request_timeout_s` after it
started plus `deadline_margin_s`, connect and response headers included. One
that has not ended by then is abandoned and counted "lost"; so `run` always
returns, at most that bound after it stops starting new requests.

Times (start, first_token, end, and `t` of first_success_after) are Unix epoch
seconds (time.time()), so they compare with the health log's ISO times
(`datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()`); deadlines are
measured on time.monotonic().
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import httpx

COMPLETED, FAILED, LOST = "completed", "failed", "lost"
TOKEN_PREFIX = "token_id:"
DEFAULT_DEADLINE_MARGIN_S = 5.0
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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class _Failure(Exception):
    def __init__(self, error_type: str, message: str, code: str | None = None):
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.code = code


class LoadDriver:
    """Streaming /v1/completions load with `concurrency` requests open at a time.

    url: the gateway's root ("http://host:port"; a trailing "/v1" is accepted).
    Prompts are used round robin: request i sends prompts[i % len(prompts)].
    `stop()` may be called from any thread (or a signal handler): no request
    starts after it; open ones run to their end or their deadline.
    """

    def __init__(self, url: str, model: str, *, prompts: list[str], api_key: str | None = None,
                 concurrency: int = 4, max_tokens: int = 32, request_timeout_s: float = 60,
                 deadline_margin_s: float = DEFAULT_DEADLINE_MARGIN_S, seed: int | None = None):
        if not prompts:
            raise ValueError("prompts must not be empty")
        if concurrency < 1 or max_tokens < 1 or request_timeout_s <= 0 or deadline_margin_s < 0:
            raise ValueError("concurrency, max_tokens, request_timeout_s must be positive, "
                             "deadline_margin_s >= 0")
        url = url.rstrip("/")
        self.url = url[:-3] if url.endswith("/v1") else url
        self.model = model
        self.prompts = list(prompts)
        self.api_key = api_key
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.request_timeout_s = float(request_timeout_s)
        self.deadline_margin_s = float(deadline_margin_s)
        self.seed = seed
        self.records: list[RequestRecord] = []
        """Every request of the current / last run, in start order (live while running)."""
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    @property
    def deadline_s(self) -> float:
        """How long the driver waits for one request before counting it lost."""
        return self.request_timeout_s + self.deadline_margin_s

    def body(self, prompt: str) -> dict:
        """The request body every drill request sends (the gateway has no ignore_eos)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0.0, "logprobs": 1, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    def stop(self) -> None:
        """Start no more requests; thread-safe. `run` returns once open ones end."""
        self._stopped = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    async def run(self, duration_s: float | None = None,
                  num_requests: int | None = None) -> list[RequestRecord]:
        """Send requests until `duration_s` passed, `num_requests` were started or
        stop() was called (whichever first; with neither limit, until stop()).
        Returns every record once every started request has ended or been
        counted lost."""
        self._stopped = False
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.records = []
        counter = itertools.count()

        def next_id() -> int | None:
            if self._stopped:
                return None
            i = next(counter)
            if num_requests is not None and i >= num_requests:
                return None
            return i

        async with self._client() as client:
            async def worker() -> None:
                while (i := next_id()) is not None:
                    record = RequestRecord(id=i, prompt_index=i % len(self.prompts),
                                           max_tokens=self.max_tokens, start=now())
                    self.records.append(record)
                    await self._request(client, record)

            workers = [asyncio.create_task(worker()) for _ in range(self.concurrency)]
            all_done = asyncio.ensure_future(asyncio.gather(*workers))
            waker = asyncio.create_task(self._wake.wait())
            try:
                await asyncio.wait({all_done, waker}, timeout=duration_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                self._stopped = True
                await all_done
            finally:
                waker.cancel()
                all_done.cancel()
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, waker, return_exceptions=True)
                self._loop = self._wake = None
        return sorted(self.records, key=lambda r: r.id)

    def run_sync(self, duration_s: float | None = None,
                 num_requests: int | None = None) -> list[RequestRecord]:
        """`run` on a fresh event loop (call from a thread without a running loop)."""
        return asyncio.run(self.run(duration_s, num_requests))

    async def reference(self, prompts: list[str] | None = None) -> dict[int, list[int]]:
        """prompt index -> the greedy token ids of that prompt: each prompt once,
        one at a time, with the same body as the load. Run it before injecting a
        fault; raises RuntimeError if any of them does not complete."""
        prompts = self.prompts if prompts is None else list(prompts)
        refs: dict[int, list[int]] = {}
        async with self._client() as client:
            for i, prompt in enumerate(prompts):
                record = RequestRecord(id=i, prompt_index=i, max_tokens=self.max_tokens,
                                       start=now())
                await self._request(client, record, prompt)
                if record.status != COMPLETED:
                    raise RuntimeError(
                        f"reference for prompt {i} did not complete: {record.status} "
                        f"({record.error_type}: {record.error})")
                refs[i] = record.token_ids
        return refs

    def reference_sync(self, prompts: list[str] | None = None) -> dict[int, list[int]]:
        return asyncio.run(self.reference(prompts))

    def _client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # httpx's own timeouts are a backstop; the deadline in _request is the bound.
        timeout = httpx.Timeout(self.deadline_s + 1.0)
        limits = httpx.Limits(max_connections=self.concurrency + 1,
                              max_keepalive_connections=self.concurrency + 1)
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout,
                                 limits=limits)

    async def _request(self, client: httpx.AsyncClient, record: RequestRecord,
                       prompt: str | None = None) -> None:
        """Send one request and fill `record`; never raises (but CancelledError),
        never takes longer than deadline_s."""
        prompt = self.prompts[record.prompt_index] if prompt is None else prompt
        try:
            async with asyncio.timeout(self.deadline_s):
                await self._stream(client, record, self.body(prompt))
        except TimeoutError:
            record.status = LOST
            record.end = None
            return
        except _Failure as exc:
            record.error_type, record.error = exc.error_type, exc.message
            record.error_code = exc.code
        except httpx.TransportError as exc:
            record.error_type = CONNECTION_ERROR
            record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        record.end = now()
        if record.error_type is None and record.finish_reason is None:
            record.error_type = INCOMPLETE_STREAM
            record.error = "the stream ended without a finish_reason"
        record.status = FAILED if record.error_type is not None else COMPLETED

    async def _stream(self, client: httpx.AsyncClient, record: RequestRecord, body: dict) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                raise await _http_failure(response)
            async for data in _sse_data(response):
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise _Failure(PROTOCOL_ERROR, f"not JSON: {data[:200]!r}") from None
                if not isinstance(chunk, dict):
                    raise _Failure(PROTOCOL_ERROR, f"not a JSON object: {data[:200]!r}")
                if "error" in chunk:
                    raise _error_failure(chunk)
                _add_chunk(record, chunk)


async def _sse_data(response: httpx.Response):
    """The data of each server-sent event (multi-line data joined by newlines)."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
        # comments (":"), event:, id:, retry: carry nothing the driver needs
    if lines:
        yield "\n".join(lines)


def _add_chunk(record: RequestRecord, chunk: dict) -> None:
    record.response_id = record.response_id or chunk.get("id")
    if chunk.get("usage"):
        record.usage = chunk["usage"]
    for choice in chunk.get("choices") or ():
        tokens = (choice.get("logprobs") or {}).get("tokens") or []
        try:
            ids = [int(t[len(TOKEN_PREFIX):]) for t in tokens if t.startswith(TOKEN_PREFIX)]
        except (TypeError, ValueError, AttributeError):
            ids = None
        if ids is None or len(ids) != len(tokens):
            raise _Failure(PROTOCOL_ERROR, f"logprob tokens are not {TOKEN_PREFIX}N: "
                                           f"{tokens[:5]!r}")
        if (ids or choice.get("text")) and record.first_token is None:
            record.first_token = now()
        record.token_ids.extend(ids)
        record.text += choice.get("text") or ""
        if choice.get("finish_reason") is not None:
            record.finish_reason = choice["finish_reason"]


def _error_failure(body) -> _Failure:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return _Failure(str(error.get("type") or "error"), str(error.get("message") or ""),
                        error.get("code"))
    return _Failure("error", str(error))


async def _http_failure(response: httpx.Response) -> _Failure:
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
    return _Failure(HTTP_ERROR, f"HTTP {response.status_code}: {text}")


def first_success_after(records: list[RequestRecord], t: float) -> float | None:
    """The earliest first-token time of a completed request that started after
    `t` (epoch seconds; a completed request without tokens counts by its end
    time); None if there is none. The drill's "recovered at"."""
    times = [r.first_token if r.first_token is not None else r.end
             for r in records if r.status == COMPLETED and r.start > t]
    times = [x for x in times if x is not None]
    return min(times, default=None)


def run_load(url: str, model: str, *, prompts: list[str], duration_s: float | None = None,
             num_requests: int | None = None, **driver_kwargs) -> list[RequestRecord]:
    """Sync: a LoadDriver(url, model, prompts=prompts, **driver_kwargs) run once.
    Give duration_s or num_requests (else it runs until the process is stopped)."""
    return LoadDriver(url, model, prompts=prompts, **driver_kwargs).run_sync(duration_s,
                                                                            num_requests)
