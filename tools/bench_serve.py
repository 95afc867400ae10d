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
the usage chunk. HTTP is httpx (one client per run); the events are
deepserve.drill.sse's parser, the one the drills use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import random
import sys
import time
from pathlib import Path
from dataclasses import asdict
from typing import Iterator

import httpx



def _sibling(name: str):
    """tools/ is no package: load a sibling module by its path, once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


stats = _sibling("bench_stats")
summarize, format_table = stats.summarize, stats.format_table  # the report's two halves

client = _sibling("bench_client")  # one request: what it sends, how it is timed
RequestResult, Target, make_client, send = (client.RequestResult, client.Target,
                                             client.make_client, client.send)
request_of = client.request_of


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
        self.client: httpx.AsyncClient | None = None

    def can_send(self) -> bool:
        if self.num_requests is not None and len(self.results) >= self.num_requests:
            self.stopped.set()
        return not self.stopped.is_set()

    async def run(self) -> float:
        """Returns the run's wall time in seconds."""
        async with make_client(self.target) as self.client:
            return await self._run()

    async def _run(self) -> float:
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
            await send(self.target, turn, list(context), result, self.client)
            if not result.ok:
                return
            context.append({"role": "assistant", "content": result.text})
        self.num_sessions_done += 1


# -- command line -------------------------------------------------------------------
async def default_model(url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s) as client:
        response = await client.get(url.rstrip("/") + "/v1/models")
    if response.status_code != 200:
        raise ConnectionError(f"GET /v1/models: HTTP {response.status_code}: "
                              f"{response.text[:200]}")
    return response.json()["data"][0]["id"]


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
