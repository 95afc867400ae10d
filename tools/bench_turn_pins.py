"""Turn pins on an agentic trace: the TTFT of the turn that brings a tool's
result, with the turn before it pinned in host memory and without.

    python tools/bench_turn_pins.py [--model models/smollm2-135m-instruct]
        [--agents 2] [--turns 4] [--context 60] [--tool-output 20] [--tool-s 2-10]
        [--max-tokens 64] [--device-tokens 1024] [--host-mb 48] [--flood 1]
        [--flood-tokens 600] [--flood-gap 0.5] [--pin-s 60] [--rounds 3] [--json pins.json]

Each agent opens with a task (--context words of a module's code, about 4
tokens a word) and the tools' system prompt; every turn is a chat request
with tool_choice "required", so its reply is a tool call; the agent then
waits --tool-s seconds (the tool runs) and sends the conversation again with
the call and the tool's output (--tool-output words) appended. Meanwhile
--flood clients send one-off prompts of about --flood-tokens each
(max_tokens 1, --flood-gap s apart), as the other users of a shared node
do: they push the agents' KV out of the device pool (--device-tokens) and
through the LRU host tier (--host-mb). TTFT is the first token's chunk (the
request asks for logprobs: a call's deltas wait for its name).

Configurations (one node each: gateway, JE, CM, kv-cache, one TE; the
cost model on, as a user gets it):
  pinned     [node] tool_call_pin_s = --pin-s
  unpinned   tool_call_pin_s = 0
Every round runs both, in that order, with the same seed; reported as
medians (min-max) over rounds: continuing turns' TTFT p50 / p90 and their
prompt tokens found cached, first turns' TTFT, turn pins taken and blocks
hit under a pin (the gateway's /metrics), the flood's requests, failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deepserve.drill.sse import aiter_sse_data
from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is no package
from bench_stats import percentile  # noqa: E402

CONFIGS = ("pinned", "unpinned")
TOOLS = [{"type": "function", "function": {
    "name": name, "description": what,
    "parameters": {"type": "object", "properties": {arg: {"type": "string", "maxLength": 40}},
                   "required": [arg]}}}
    for name, what, arg in (("read_file", "Read a file of the repository", "path"),
                            ("run_tests", "Run the tests that match a pattern", "pattern"),
                            ("grep", "Search the repository for a string", "query"))]
WORDS = ("def class return self value index items parse buffer token cache block "
         "request reply engine worker layer shape batch limit queue timeout").split()


def node_config(name: str, args, model: Path) -> NodeConfig:
    te = {"num_kv_blocks": args.device_tokens // 16, "max_num_batched_tokens": 512}
    return NodeConfig.build(model=str(model), served_model="m", port=free_port(),
                            startup_timeout_s=300, host_cache_bytes=args.host_mb << 20,
                            tool_call_pin_s=args.pin_s if name == "pinned" else 0.0,
                            tes=[TESpec("te0", "colocated", te)])


def text(rng: random.Random, num_words: int) -> str:
    lines, line = [], []
    for _ in range(num_words):
        line.append(rng.choice(WORDS) + str(rng.randrange(100)))
        if len(line) == 8:
            lines.append("    " + " ".join(line))
            line = []
    return "\n".join(lines + ["    " + " ".join(line)])


async def chat(http: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int
               ) -> dict:
    """One streamed chat turn: TTFT, the tool calls it made, usage. A call's
    deltas wait until its name is read, so each token's logprobs mark the first
    token (with logprobs on, every token has a chunk)."""
    body = {"model": "m", "messages": messages, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}
    t0, out = time.perf_counter(), {"ttft_s": None, "calls": {}, "usage": None, "error": None}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            return out
        async for data in aiter_sse_data(r):
            if data.strip() == "[DONE]":
                break
            obj = json.loads(data)
            out["usage"] = obj.get("usage") or out["usage"]
            out["error"] = obj.get("error") or out["error"]
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                first = delta.get("content") or delta.get("tool_calls") or choice.get("logprobs")
                if first and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                for call in delta.get("tool_calls") or []:
                    got = out["calls"].setdefault(call["index"], {"id": "", "name": "", "args": ""})
                    fn = call.get("function") or {}
                    got["id"] = call.get("id") or got["id"]
                    got["name"] = fn.get("name") or got["name"]
                    got["args"] += fn.get("arguments") or ""
    return out


async def agent(http, url: str, args, rng: random.Random, i: int, results: list) -> None:
    messages = [{"role": "user", "content": f"Task {i}: fix the failing test in this module.\n"
                 f"```python\n{text(rng, args.context)}\n```"}]
    for turn in range(args.turns):
        out = await chat(http, url, messages, args.max_tokens)
        usage = out["usage"] or {}
        results.append({"agent": i, "turn": turn, "ttft_s": out["ttft_s"],
                        "error": out["error"] or (None if out["calls"] else
                                                  "no tool call (cut at --max-tokens?)"),
                        "prompt_tokens": usage.get("prompt_tokens", 0),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {})
                        .get("cached_tokens", 0)})
        if not out["calls"]:
            return
        await asyncio.sleep(rng.uniform(*args.tool_s))  # the tool runs
        call = out["calls"][0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
                          "id": call["id"], "type": "function",
                          "function": {"name": call["name"], "arguments": call["args"]}}]},
                     {"role": "tool", "tool_call_id": call["id"],
                      "content": text(rng, args.tool_output)}]


async def flood(http, url: str, args, rng: random.Random, stop: asyncio.Event,
                counts: list) -> None:
    while not stop.is_set():
        body = {"model": "m", "prompt": text(rng, args.flood_tokens // 4), "max_tokens": 1}
        r = await http.post(f"{url}/v1/completions", json=body)
        counts.append(r.status_code == 200)
        await asyncio.sleep(args.flood_gap)  # a busy node, not a saturated one


async def trace(url: str, args, seed: int) -> tuple[list, list, float]:
    results, counts, stop = [], [], asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as http:
        floods = [asyncio.create_task(flood(http, url, args, random.Random(seed * 100 + f),
                                            stop, counts)) for f in range(args.flood)]
        started = time.perf_counter()
        await asyncio.gather(*(agent(http, url, args, random.Random(seed * 1000 + i), i, results)
                               for i in range(args.agents)))
        wall = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*floods)
    return results, counts, wall


def scrape(url: str) -> dict:
    text_ = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text_)
            for s in fam.samples if not s.labels}


def run_one(name: str, args, model: Path, seed: int) -> dict:
    node = Node(node_config(name, args, model))
    node.start()
    try:
        results, counts, wall = asyncio.run(trace(node.url, args, seed))
        time.sleep(1.5)  # the last tier report reaches the gateway
        metrics = scrape(node.url)
    finally:
        node.stop()
    ok = [r for r in results if r["error"] is None and r["ttft_s"] is not None]
    later = [r for r in ok if r["turn"] > 0]
    return {"config": name, "seed": seed, "wall_s": wall, "num_turns": len(results),
            "num_failed": len(results) - len(ok), "flood_requests": len(counts),
            "flood_failed": counts.count(False),
            "ttft_p50_s": percentile([r["ttft_s"] for r in later], 50),
            "ttft_p90_s": percentile([r["ttft_s"] for r in later], 90),
            "first_ttft_p50_s": percentile([r["ttft_s"] for r in ok if r["turn"] == 0], 50),
            "cached_share": sum(r["cached_tokens"] for r in later)
            / max(1, sum(r["prompt_tokens"] for r in later)),
            "turn_pins_refused": metrics.get("deepserve_turn_pins_refused_total", 0.0),
            "pin_hit_blocks": metrics.get("deepserve_turn_pin_hit_blocks_total", 0.0),
            "errors": sorted({str(r["error"])[:160] for r in results if r["error"]})[:3],
            "turns": results}


def _med(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r[key] is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(runs: list[dict]) -> str:
    lines = ["| config | TTFT p50 turns 2..n (s) | TTFT p90 (s) | cached share turns 2..n | "
             "first-turn TTFT p50 (s) | blocks hit under a pin | pins refused | flood requests "
             "| failed |", "|" + "---|" * 9]
    for name in CONFIGS:
        rows = [r for r in runs if r["config"] == name]
        lines.append("| " + " | ".join([name, _med(rows, "ttft_p50_s"), _med(rows, "ttft_p90_s"),
                                 _med(rows, "cached_share"), _med(rows, "first_ttft_p50_s"),
                                 _med(rows, "pin_hit_blocks"), _med(rows, "turn_pins_refused"),
                                 _med(rows, "flood_requests"),
                                 str(sum(r["num_failed"] + r["flood_failed"] for r in rows))])
                     + " |")
    return "\n".join(lines)


def _range(value: str) -> tuple[float, float]:
    lo, _, hi = value.partition("-")
    return float(lo), float(hi or lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--context", type=int, default=60,
                   help="words of the task's code (about 4 tokens each)")
    p.add_argument("--tool-output", type=int, default=20, help="words of each tool's output")
    p.add_argument("--tool-s", type=_range, default=(2.0, 10.0))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device-tokens", type=int, default=1024)
    p.add_argument("--host-mb", type=int, default=48)
    p.add_argument("--flood-tokens", type=int, default=600)
    p.add_argument("--flood", type=int, default=1, help="flood clients")
    p.add_argument("--flood-gap", type=float, default=0.5, help="seconds between a client's")
    p.add_argument("--pin-s", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = []
    for r in range(args.rounds):
        for name in CONFIGS:
            runs.append(run_one(name, args, Path(args.model), seed=r + 1))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "turns"}), flush=True)
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
