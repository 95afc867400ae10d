"""KV tiers on an agentic multi-turn trace: device-only, + host, + host + disk,
everything recomputed, and token-id continuity on and off, side by side.

    python tools/bench_tiers.py [--model models/small] [--sessions 8] [--turns 4]
        [--context 1200] [--append 60-120] [--max-tokens 24] [--concurrency 2]
        [--device-tokens 3072] [--host-mb 256] [--small-host-mb 48] [--disk-mb 2048]
        [--rounds 2] [--configs recompute,device,host,host_disk,host_disk_nocont]
        [--json tiers.json]

The trace (tools/traces.py's agentic sessions): each session opens with a long
context (a system prompt and a task with a module's code, --context tokens)
and every later turn appends the assistant's real reply and a short tool
output (--append tokens), so turn n+1's prompt is turn n's prompt + reply +
a little. Sessions run interleaved (turn t of every session, --concurrency at
a time, then turn t+1), so with a device pool of --device-tokens the other
sessions push a session's KV out of the device between its turns: the
working set (sessions x context) is several times what the pool holds.

Configurations (one node each: gateway, JE, CM, one TE with that pool):
  recompute         prefix caching off: every prompt token computed
  device            prefix caching on the device pool only
  host              + a host tier of --host-mb (holds the working set)
  host_disk         + a host tier of --small-host-mb and a disk tier of --disk-mb
  host_disk_nocont  host_disk with [router] token_continuity = false
Every round runs every configuration once, in that order (one node at a
time), on a trace of its own seed: configurations are compared within a
round and reported as medians (min-max) over rounds.

Per configuration: TTFT p50 / p90 of the continuing turns (2..n) and of the
first turns, the cache hit rate by tier (prompt tokens served from device,
host or disk, from the gateway's deepserve_cache_hit_tokens_total / prompt
tokens), the bytes moved up from host and from disk, failed requests.
The host_disk node also runs a probe (--no-probe: not): a 40-token prefix
and a 1024-token one (at most half the device pool), each left only in the disk tier, sent again; it shows
what the cost model fetched and the measured numbers it decided with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deepserve.ipc.sockets import free_port
from deepserve.model.config import load_model_config
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is no package
import bench_client as client  # noqa: E402
import traces  # noqa: E402
from bench_stats import percentile  # noqa: E402

CONFIGS = ("recompute", "device", "host", "host_disk", "host_disk_nocont")
TIERS = ("device", "host", "disk")


def node_config(name: str, args, model: Path, disk_dir: Path) -> NodeConfig:
    te = {"num_kv_blocks": args.device_tokens // 16, "max_num_batched_tokens": 512,
          "enable_prefix_caching": name != "recompute"}
    keys = {}
    if name == "host":
        keys = {"host_cache_bytes": args.host_mb << 20}
    elif name.startswith("host_disk"):
        keys = {"host_cache_bytes": args.small_host_mb << 20, "disk_cache_dir": str(disk_dir),
                "disk_cache_bytes": args.disk_mb << 20}
    return NodeConfig.build(model=str(model), served_model="m", port=free_port(),
                            startup_timeout_s=300, token_continuity=name != "host_disk_nocont",
                            tes=[TESpec("te0", "colocated", te)], **keys)


def trace(args, seed: int, model: Path) -> list[dict]:
    count = traces.make_counter(str(model))
    lo, hi = args.append
    return list(traces.gen_agentic(random.Random(seed), args.sessions, (args.turns, args.turns),
                                   (args.context, args.context), (lo, hi),
                                   (args.max_tokens, args.max_tokens), count))


async def replay(url: str, sessions: list[dict], concurrency: int) -> list:
    target = client.Target(url=url, model="m", extra={"temperature": 0})
    contexts = [[] for _ in sessions]
    results = []
    gate = asyncio.Semaphore(concurrency)
    async with client.make_client(target) as http:
        async def one(i: int, turn_no: int) -> None:
            turn = sessions[i]["turns"][turn_no]
            contexts[i] += turn["messages"]
            result = client.RequestResult(sessions[i]["id"], turn_no)
            async with gate:
                await client.send(target, turn, list(contexts[i]), result, http)
            contexts[i].append({"role": "assistant", "content": result.text})
            results.append(result)
        for turn_no in range(len(sessions[0]["turns"])):
            await asyncio.gather(*(one(i, turn_no) for i in range(len(sessions))))
    return results


def scrape(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def hit_tokens(metrics: dict) -> dict[str, float]:
    return {t: metrics.get(("deepserve_cache_hit_tokens_total", (("tier", t),)), 0.0)
            for t in TIERS}


def run_one(name: str, args, model: Path, seed: int, kv_bytes_per_token: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvdisk") as disk:
        node = Node(node_config(name, args, model, Path(disk)))
        node.start()
        try:
            before = hit_tokens(scrape(node.url))
            started = time.perf_counter()
            results = asyncio.run(replay(node.url, trace(args, seed, model), args.concurrency))
            wall = time.perf_counter() - started
            time.sleep(1.5)  # the last TEReports reach the gateway
            after = hit_tokens(scrape(node.url))
            probe = None
            if name == "host_disk" and args.probe:
                probe = probe_cost_model(node.url, load_model_config(model).vocab_size,
                                         min(1024, args.device_tokens // 2))
        finally:
            node.stop()
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok) or 1
    hits = {t: after[t] - before[t] for t in TIERS}
    later = [r.ttft_s for r in ok if r.turn > 0 and r.ttft_s is not None]
    first = [r.ttft_s for r in ok if r.turn == 0 and r.ttft_s is not None]
    return {"config": name, "seed": seed, "wall_s": wall, "num_ok": len(ok),
            "num_failed": len(results) - len(ok), "prompt_tokens": prompt,
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "ttft_p50_s": percentile(later, 50), "ttft_p90_s": percentile(later, 90),
            "first_ttft_p50_s": percentile(first, 50),
            **{f"hit_{t}": hits[t] / prompt for t in TIERS},
            "host_bytes": hits["host"] * kv_bytes_per_token,
            "disk_bytes": hits["disk"] * kv_bytes_per_token, "probe": probe,
            "errors": sorted({(r.error or "")[:160] for r in results if not r.ok})[:3]}


def probe_cost_model(url: str, vocab: int, long_len: int) -> dict:
    """A short prefix and a long one, each pushed out of the device and the
    host tier (so only its block files hold it), then sent again: what the
    cost model fetched (cached tokens) and the numbers it decided with."""
    rng = random.Random(7)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def send(ids: list[int]) -> int:
        body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
        if "usage" not in r:
            raise RuntimeError(f"probe request failed: {r}")
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    short, long_ = prompt(40), prompt(long_len)
    out = {}
    for name, ids in (("short", short), ("long", long_)):
        send(ids)
        for _ in range(4):  # other prompts: out of the device pool and the host tier
            send(prompt(long_len))
        time.sleep(1.0)
        out[f"{name}_prompt_tokens"] = len(ids)
        out[f"{name}_cached_tokens"] = send(ids)
    time.sleep(1.5)
    metrics = scrape(url)
    out["cost_model"] = {dict(k[1])["param"]: v for k, v in metrics.items()
                         if k[0] == "deepserve_te_cost_model"}
    return out


def _med(rows: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in rows if r[key] is not None]
    return (statistics.median(values), min(values), max(values)) if values else (0, 0, 0)


def table(runs: list[dict], configs) -> str:
    head = ("| config | TTFT p50 turns 2..n (s) | TTFT p90 (s) | first-turn TTFT p50 (s) | "
            "hit device | hit host | hit disk | MB from host | MB from disk | failed |")
    lines = [head, "|" + "---|" * 10]
    for name in configs:
        rows = [r for r in runs if r["config"] == name]
        p50, lo, hi = _med(rows, "ttft_p50_s")
        cells = [name, f"{p50:.3f} ({lo:.3f}-{hi:.3f})", f"{_med(rows, 'ttft_p90_s')[0]:.3f}",
                 f"{_med(rows, 'first_ttft_p50_s')[0]:.3f}",
                 *[f"{100 * _med(rows, f'hit_{t}')[0]:.1f}%" for t in TIERS],
                 f"{_med(rows, 'host_bytes')[0] / 1e6:.1f}",
                 f"{_med(rows, 'disk_bytes')[0] / 1e6:.1f}",
                 str(sum(r["num_failed"] for r in rows))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "small"))
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=1200)
    ap.add_argument("--append", type=traces.parse_range, default=(60, 120))
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--device-tokens", type=int, default=3072)
    ap.add_argument("--host-mb", type=int, default=256)
    ap.add_argument("--small-host-mb", type=int, default=48)
    ap.add_argument("--disk-mb", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="skip the cost-model probe (short vs long prefix on disk)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    model = Path(args.model)
    if not (model / "config.json").is_file():
        preset = "small" if "small" in model.name else "tiny"
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(model),
                        "--preset", preset], check=True)
    m = load_model_config(model)
    kv_bytes_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype.itemsize
    configs = [c for c in args.configs.split(",") if c]
    runs = []
    for round_no in range(args.rounds):
        for name in configs:
            row = run_one(name, args, model, seed=1000 + round_no, kv_bytes_per_token=
                          kv_bytes_per_token)
            runs.append(row)
            print(json.dumps(row), flush=True)
    print(table(runs, configs))
    for row in runs:
        if row.get("probe"):
            print("cost model probe:", json.dumps(row["probe"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args) | {"append": args.append},
                                               "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
