"""Serving benchmark: replay a trace (tools/traces.py) against the gateway over HTTP.

    python tools/bench_serve.py --url http://127.0.0.1:8000 --trace chat.jsonl \\
        [--mode open --rate 2 | --mode closed --concurrency 4] \\
        [--duration 120] [--num-requests 100] [--model NAME] [--api-key K] [--json-out F]

Every request streams (`stream_options.include_usage`): records with
`messages` go to /v1/chat/completions, records with `prompt` to
/v1/completions. An agentic record is a session: its turns run back to back,
each sending the whole context so far + the real replies + the new message.

  open    sessions (single requests for chat/code) start as a Poisson process
          of --rate per second, however many are still running
  closed  --concurrency clients, each starting the next session when its
          previous one ended

The run stops sending at --duration seconds or after --num-requests requests
(or when the trace is used up; --cycle repeats it, which inflates cache hits);
requests still running then get --grace seconds, after which they are
cancelled and counted as failed. Every request has --request-timeout.

Per request: TTFT (first content chunk), inter-token latencies (gaps between
content chunks; a chunk may hold several tokens), TPOT = (e2e - TTFT) /
(completion tokens - 1), end-to-end, prompt / cached / completion tokens from
the usage chunk. Stdlib only: a small HTTP/1.1 client on asyncio streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import ssl
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Iterator

MAX_ERROR_BODY = 2048


# -- HTTP/1.1 over asyncio streams ----------------------------------------------------
async def http_open(url: str, method: str, body: bytes, headers: dict[str, str]):
    """Send one request (Connection: close); returns (status, headers, reader, writer)."""
    u = urllib.parse.urlsplit(url)
    secure = u.scheme == "https"
    reader, writer = await asyncio.open_connection(
        u.hostname, u.port or (443 if secure else 80),
        ssl=ssl.create_default_context() if secure else None, limit=1 << 20)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    head = [f"{method} {path} HTTP/1.1", f"Host: {u.netloc}", "Connection: close",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        writer.close()
        raise ConnectionError(f"bad status line {status_line[:80]!r}")
    response_headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        response_headers[key.strip().lower()] = value.strip()
    return int(parts[1]), response_headers, reader, writer


async def http_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while (size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16)):
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF after the chunk
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass  # trailers
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data


async def read_body(reader, headers, limit: int = MAX_ERROR_BODY) -> str:
    out = b""
    async for data in http_body(reader, headers):
        out += data
        if len(out) >= limit:
            break
    return out[:limit].decode("utf-8", "replace")


class SSEParser:
    """Bytes in, the `data` of each complete server-sent event out."""

    def __init__(self):
        self._buf, self._data = b"", []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


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


async def send(target: Target, turn: dict, context: list[dict], result: RequestResult) -> None:
    """Stream one request into `result` (never raises, except when cancelled)."""
    path, payload = request_of(target, turn, context)
    stream = _Stream(result, time.perf_counter())
    try:
        async with asyncio.timeout(target.timeout_s):
            status, headers, reader, writer = await http_open(
                target.url.rstrip("/") + path, "POST", json.dumps(payload).encode(),
                target.headers())
            result.status = status
            try:
                if status != 200:
                    result.error = f"HTTP {status}: {await read_body(reader, headers)}"
                    return
                parser = SSEParser()
                async for chunk in http_body(reader, headers):
                    now = time.perf_counter()
                    for data in parser.feed(chunk):
                        stream.on_event(data, now)
            finally:
                writer.close()
    except TimeoutError:
        result.error = f"timeout after {target.timeout_s:g} s"
    except asyncio.CancelledError:
        result.error = "cancelled: still running when the grace period ended"
        raise
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        stream.finish()


# -- the run ------------------------------------------------------------------------
def record_turns(record: dict) -> list[dict]:
    if "turns" in record:
        return record["turns"]
    keys = ("messages", "prompt", "max_tokens")
    return [{k: record[k] for k in keys if k in record}]


class Bench:
    """Sends the trace's sessions until a stop condition; keeps every result."""

    def __init__(self, target: Target, records: list[dict], mode: str, rate: float = 1.0,
                 concurrency: int = 1, duration_s: float | None = None,
                 num_requests: int | None = None, grace_s: float = 120.0, cycle: bool = False,
                 seed: int = 0):
        self.target, self.mode, self.rate, self.concurrency = target, mode, rate, concurrency
        self.duration_s, self.num_requests, self.grace_s = duration_s, num_requests, grace_s
        self.sessions: Iterator[dict] = itertools.cycle(records) if cycle else iter(records)
        self.rng = random.Random(seed)
        self.results: list[RequestResult] = []
        self.num_sessions_started = self.num_sessions_done = 0
        self.stopped = asyncio.Event()
        self.t0 = 0.0

    def can_send(self) -> bool:
        if self.num_requests is not None and len(self.results) >= self.num_requests:
            self.stopped.set()
        return not self.stopped.is_set()

    async def run(self) -> float:
        """Returns the run's wall time in seconds."""
        self.t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.duration_s, self.stopped.set) if self.duration_s else None
        launcher = asyncio.create_task(self._open() if self.mode == "open" else self._closed())
        stop = asyncio.create_task(self.stopped.wait())
        await asyncio.wait({launcher, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not launcher.done():  # stop fired: stragglers get the grace period
            await asyncio.wait({launcher}, timeout=self.grace_s)
            launcher.cancel()
        await asyncio.gather(launcher, return_exceptions=True)
        stop.cancel()
        if timer:
            timer.cancel()
        return time.perf_counter() - self.t0

    async def _open(self) -> None:
        async with asyncio.TaskGroup() as group:
            for number, record in enumerate(self.sessions):
                if number:  # Poisson arrivals; the first starts at once
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stopped.wait(), self.rng.expovariate(self.rate))
                if not self.can_send():
                    break
                group.create_task(self._session(record, number))

    async def _closed(self) -> None:
        counter = itertools.count()

        async def client() -> None:
            for record in self.sessions:
                if not self.can_send():
                    return
                await self._session(record, next(counter))

        async with asyncio.TaskGroup() as group:
            for _ in range(self.concurrency):
                group.create_task(client())

    async def _session(self, record: dict, number: int) -> None:
        self.num_sessions_started += 1
        context: list[dict] = []
        name = f"{record.get('id', 'record')}#{number}"
        for i, turn in enumerate(record_turns(record)):
            if not self.can_send():
                return
            context += turn.get("messages", [])
            result = RequestResult(name, i, start_s=time.perf_counter() - self.t0)
            self.results.append(result)
            if self.num_requests is not None and len(self.results) >= self.num_requests:
                self.stopped.set()  # the last one: from now on stragglers have the grace period
            await send(self.target, turn, list(context), result)
            if not result.ok:
                return
            context.append({"role": "assistant", "content": result.text})
        self.num_sessions_done += 1


# -- summary ------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """q in [0, 100]; linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values: list[float]) -> dict:
    out = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    out["mean"] = sum(values) / len(values) if values else None
    return {k: None if v is None else v * 1000 for k, v in out.items()}


def summarize(results: list[RequestResult], duration_s: float, num_sessions_started: int = 0,
              num_sessions_done: int = 0) -> dict:
    ok = [r for r in results if r.ok]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    errors = Counter((r.error or "")[:200] for r in results if not r.ok)
    return {
        "duration_s": duration_s, "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "num_sessions_started": num_sessions_started, "num_sessions_done": num_sessions_done,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": completion / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
        "cache_hit_rate": cached / prompt if prompt else None,
        "num_without_usage": sum(1 for r in ok if not r.has_usage),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "errors": dict(errors.most_common(5)),
    }


def format_table(s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}"
    hit = "-" if s["cache_hit_rate"] is None else f"{100 * s['cache_hit_rate']:.1f}%"
    lines = [f"requests ok / failed   {s['num_ok']} / {s['num_failed']}   "
             f"(sessions done {s['num_sessions_done']} / {s['num_sessions_started']})",
             f"duration               {s['duration_s']:.1f} s",
             f"throughput             {s['request_throughput']:.2f} req/s   "
             f"{s['output_throughput']:.1f} output tok/s",
             f"tokens                 prompt {s['prompt_tokens']}  cached {s['cached_tokens']}  "
             f"completion {s['completion_tokens']}",
             f"prefix-cache hit rate  {hit}",
             f"{'(ms)':<22} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}"]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "inter-token"),
                       ("e2e_ms", "end-to-end")):
        d = s[key]
        cells = " ".join(f"{ms(d[k]):>9}" for k in ("p50", "p90", "p99", "mean"))
        lines.append(f"{label:<22} {cells}")
    if s["num_without_usage"]:
        lines.append(f"{s['num_without_usage']} ok request(s) had no usage chunk (tokens = chunks)")
    lines += [f"error x{n}: {e}" for e, n in s["errors"].items()]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------
async def default_model(url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with asyncio.timeout(timeout_s):
        status, h, reader, writer = await http_open(url.rstrip("/") + "/v1/models", "GET", b"",
                                                    headers)
        try:
            body = await read_body(reader, h, limit=1 << 20)
        finally:
            writer.close()
    if status != 200:
        raise ConnectionError(f"GET /v1/models: HTTP {status}: {body[:200]}")
    return json.loads(body)["data"][0]["id"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--trace", required=True, help="JSON lines from tools/traces.py")
    ap.add_argument("--mode", choices=("open", "closed"), default="closed")
    ap.add_argument("--rate", type=float, default=1.0, help="open loop: sessions per second")
    ap.add_argument("--concurrency", type=int, default=4, help="closed loop: clients")
    ap.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    ap.add_argument("--num-requests", type=int, default=None, help="stop after N requests")
    ap.add_argument("--cycle", action="store_true", help="repeat the trace until a limit")
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--grace", type=float, default=120.0, help="seconds for stragglers at the end")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    ap.add_argument("--seed", type=int, default=0, help="Poisson arrivals")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.concurrency < 1:
        ap.error("--rate must be > 0 and --concurrency >= 1")
    if args.cycle and args.duration is None and args.num_requests is None:
        ap.error("--cycle needs --duration or --num-requests")
    return args


async def run(args: argparse.Namespace) -> dict:
    with open(args.trace, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    model = args.model or await default_model(args.url, args.api_key)
    extra = {} if args.temperature is None else {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    bench = Bench(Target(args.url, model, args.api_key, args.request_timeout, extra), records,
                  args.mode, args.rate, args.concurrency, args.duration, args.num_requests,
                  args.grace, args.cycle, args.seed)
    duration = await bench.run()
    summary = summarize(bench.results, duration, bench.num_sessions_started,
                        bench.num_sessions_done)
    config = {k: v for k, v in vars(args).items() if k != "api_key"} | {"model": model}
    requests = [{k: v for k, v in asdict(r).items() if k != "text"} | {"tpot_s": r.tpot_s}
                for r in bench.results]
    return {"config": config, "summary": summary, "requests": requests}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print(format_table(report["summary"]))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0 if report["summary"]["num_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
