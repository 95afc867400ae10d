"""Load for fault-injection drills: streaming /v1/completions, every request accounted.

    LoadDriver ── `concurrency` workers, each: POST /v1/completions (stream, logprobs 1,
                  temperature 0) ──SSE──> stream.read_stream ──> RequestRecord
               └─ reference(): each prompt once, sequentially, before any fault

How a stream is read and judged (token ids, errors) is stream.py; this module
only starts requests and bounds them. Every request is bounded by the driver
itself: `request_timeout_s` after it started plus `deadline_margin_s`, connect
and response headers included. One that has not ended by then is abandoned
and counted "lost"; so `run` always returns, at most that bound after it stops
starting new requests.

Times (start, first_token, end, and `t` of first_success_after) are Unix epoch
seconds (time.time()), so they compare with the health log's ISO times
(`datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()`); deadlines are
measured on time.monotonic().
"""

from __future__ import annotations

import asyncio
import itertools

import httpx

from deepserve.drill.stream import (COMPLETED, CONNECTION_ERROR, FAILED, INCOMPLETE_STREAM,
                                    LOST, RequestRecord, StreamFailure, first_success_after,
                                    now, read_response, read_stream)

__all__ = ["COMPLETED", "FAILED", "LOST", "LoadDriver", "RequestRecord", "first_success_after",
           "now", "run_load"]

DEFAULT_DEADLINE_MARGIN_S = 5.0
RECONNECT_S = 0.2
"""A worker's pause after a connection error (a killed gateway) before its next request."""


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
                "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True,
                "stream": True,
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
                    if record.error_type == CONNECTION_ERROR:  # as a client would: not
                        await asyncio.sleep(RECONNECT_S)  # hundreds of refusals a second

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

    def send_sync(self, prompt: str) -> RequestRecord:
        """One request of `prompt` (the load's body), outside any run, e.g. a
        cache probe; its record is not among `records`."""
        async def one() -> RequestRecord:
            record = RequestRecord(id=-1, prompt_index=-1, max_tokens=self.max_tokens,
                                   start=now())
            async with self._client() as client:
                await self._request(client, record, prompt)
            return record
        return asyncio.run(one())

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
        await self.send(client, record, "/v1/completions", self.body(prompt))

    async def send(self, client: httpx.AsyncClient, record: RequestRecord, path: str,
                   body: dict | bytes, headers: dict | None = None) -> None:
        """POST `body` to `path` and fill `record`: streamed (SSE) when the body
        says "stream": true, else one JSON response; bytes go as they are
        (a malformed body on purpose). Never raises (but CancelledError), never
        takes longer than deadline_s. bin/deepserve-chaos sends its mix this way."""
        try:
            async with asyncio.timeout(self.deadline_s):
                if isinstance(body, dict) and body.get("stream"):
                    async with client.stream("POST", path, json=body,
                                             headers=headers) as response:
                        await read_stream(response, record)
                else:
                    content = body if isinstance(body, bytes) else None
                    async with client.stream("POST", path, content=content,
                                             json=None if content is not None else body,
                                             headers={"Content-Type": "application/json",
                                                      **(headers or {})}) as response:
                        await read_response(response, record)
        except TimeoutError:
            record.status = LOST
            record.end = None
            return
        except StreamFailure as exc:
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


def run_load(url: str, model: str, *, prompts: list[str], duration_s: float | None = None,
             num_requests: int | None = None, **driver_kwargs) -> list[RequestRecord]:
    """Sync: a LoadDriver(url, model, prompts=prompts, **driver_kwargs) run once.
    Give duration_s or num_requests (else it runs until the process is stopped)."""
    return LoadDriver(url, model, prompts=prompts, **driver_kwargs).run_sync(duration_s,
                                                                            num_requests)
