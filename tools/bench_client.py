"""One request of tools/bench_serve.py: what it sends, how its stream is read
and timed (TTFT, inter-token gaps, usage), and how a failure is recorded.
HTTP is httpx; the events are deepserve.drill.sse's parser, the one the
drills use."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from deepserve.drill.sse import aiter_sse_data

MAX_ERROR_BODY = 2048


# -- one request --------------------------------------------------------------------
@dataclass
class RequestResult:
    session: str
    turn: int
    start_s: float = 0.0  # since the run started
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    has_usage: bool = False
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 300.0
    extra: dict = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def request_of(target: Target, turn: dict, context: list[dict]) -> tuple[str, dict]:
    """(path, JSON body): a `prompt` turn is a completion, a `messages` turn a chat."""
    payload = {"model": target.model, "max_tokens": turn["max_tokens"], "stream": True,
               "stream_options": {"include_usage": True}, **target.extra}
    if "prompt" in turn:
        return "/v1/completions", payload | {"prompt": turn["prompt"]}
    return "/v1/chat/completions", payload | {"messages": context}


class _Stream:
    """Folds the SSE events of one response into its RequestResult."""

    def __init__(self, result: RequestResult, t0: float):
        self.result, self.t0 = result, t0
        self.last: float | None = None
        self.pieces: list[str] = []
        self.is_done = False

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.is_done = True
            return
        obj, result = json.loads(data), self.result
        if obj.get("error"):
            result.error = "stream error: " + json.dumps(obj["error"])[:MAX_ERROR_BODY]
        for choice in obj.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or choice.get("text")
            if piece:
                if self.last is None:
                    result.ttft_s = now - self.t0
                else:
                    result.itl_s.append(now - self.last)
                self.last = now
                self.pieces.append(piece)
        usage = obj.get("usage")
        if usage:
            result.has_usage = True
            result.prompt_tokens = usage.get("prompt_tokens") or 0
            result.completion_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens") or 0

    def finish(self) -> None:
        result = self.result
        result.e2e_s = time.perf_counter() - self.t0
        result.text = "".join(self.pieces)
        if result.error is None and not self.is_done:
            result.error = "stream ended without [DONE]"
        result.ok = result.error is None
        if not result.has_usage:
            result.completion_tokens = len(self.pieces)  # one chunk ~ one token


def make_client(target: Target) -> httpx.AsyncClient:
    """One client for a run: no pool limit (open-loop arrivals must not queue
    here) and no httpx timeouts (send's own deadline bounds each request)."""
    return httpx.AsyncClient(headers=target.headers(), timeout=None,
                             limits=httpx.Limits(max_connections=None))


async def send(target: Target, turn: dict, context: list[dict], result: RequestResult,
               client: httpx.AsyncClient | None = None) -> None:
    """Stream one request into `result` (never raises, except when cancelled).
    Without `client`, a client of its own for this one request."""
    if client is None:
        async with make_client(target) as own:
            return await send(target, turn, context, result, own)
    path, payload = request_of(target, turn, context)
    stream = _Stream(result, time.perf_counter())
    try:
        async with asyncio.timeout(target.timeout_s):
            async with client.stream("POST", target.url.rstrip("/") + path,
                                     json=payload) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {await _error_body(response)}"
                    return
                async for data in aiter_sse_data(response):
                    stream.on_event(data, time.perf_counter())
    except TimeoutError:
        result.error = f"timeout after {target.timeout_s:g} s"
    except asyncio.CancelledError:
        result.error = "cancelled: still running when the grace period ended"
        raise
    except (httpx.HTTPError, OSError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        stream.finish()


async def _error_body(response: httpx.Response) -> str:
    out = b""
    async for data in response.aiter_bytes():
        out += data
        if len(out) >= MAX_ERROR_BODY:
            break
    return out[:MAX_ERROR_BODY].decode("utf-8", "replace")
