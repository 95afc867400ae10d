"""Profile DeepServe's PD heatmap (PAPERS.md 1.8, Fig. 6): where is a prefill/decode
pair faster than a colocated TE?

    python tools/profile_pd.py --model models/tiny --out conf/pd_heatmap.json \\
        [--prompt-lens 128,512,1024,1536] [--ratios 0.03125,0.125,0.5,1] [--rates 2,8,24] \\
        [--requests-per-cell 12] [--arrivals fixed|poisson] [--colocated-tes 1] [--quick]

Two nodes, each started once and kept up for the whole run (both idle
between their turns; the measurements interleave A and B per (cell, rate), so
a drift in background load hits both layouts alike):

  A  colocated      --colocated-tes colocated TEs (default 1), pd_policy unset
  B  disaggregated  one prefill TE + one decode TE (1P1D), pd_policy "disaggregated"

For every cell (prompt length p, decode/prompt ratio r -> d = round(p * r)
output tokens) and every rate, the same --requests-per-cell requests go to A
and then to B (the order alternates cell by cell): each a different prompt of
p random token ids (no prefix-cache hits, special tokens excluded), max_tokens
d, temperature 0, streamed through the gateway (tools/bench_serve.py's client),
arriving at fixed intervals of 1/rate s (or Poisson, --arrivals poisson).
JCT of a request = its end - its start (bench_serve's end-to-end time). Cell
value at one rate = mean JCT(A) / mean JCT(B) - 1 (+ = disaggregated faster);
the per-rate maps are summed element-wise (Heatmap.combine, as the paper does).
Cells with p + d over the model's context (max_position_embeddings) are null
(unmeasured), as is a cell where every request of a layout failed.

Output length: the gateway has no ignore_eos (gateway/http/schemas.py ignores the
field), so a greedy output may end early at EOS. Both layouts get the same
prompts and greedy decoding, so they produce the same outputs (up to numeric
noise); the mean completion tokens of both are printed and kept in the raw
file (--raw-out), and cells whose mean output is under 90 % of d are flagged.

Fairness: layout B runs 2 TEs (2 worker processes, --threads torch threads
each) where A runs --colocated-tes TEs. On a 2-core machine B gets twice the
CPU of A=1; --colocated-tes 2 compares equal process counts (A then routes by
load over its two TEs). The printout and the file's notes say which was used.

Grid bins: edges are the geometric midpoints between the measured points, 0
below the first and twice the last point above (Heatmap.lookup clamps beyond).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from deepserve.control.je.routing.pd_heatmap import Heatmap
from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("colocated", "disaggregated")


def bench_serve_module():
    """tools/bench_serve.py, imported (tools/ is no package)."""
    if "bench_serve" in sys.modules:
        return sys.modules["bench_serve"]
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "tools" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module
    spec.loader.exec_module(module)
    return module



def edges_of(points: list[float], integer: bool) -> list[float]:
    mids = [math.sqrt(a * b) for a, b in zip(points, points[1:])]
    edges = [0, *mids, 2 * points[-1]]
    return [int(round(e)) for e in edges] if integer else [round(e, 6) for e in edges]


def model_limits(model: Path) -> tuple[int, int, set[int]]:
    """(context length, vocab size, special token ids)."""
    config = json.loads((model / "config.json").read_text())
    special: set[int] = set()
    tok = model / "tokenizer.json"
    if tok.exists():
        special = {a["id"] for a in json.loads(tok.read_text()).get("added_tokens", [])}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config.get(key)
        special |= set(v if isinstance(v, list) else [v] if v is not None else [])
    return int(config.get("max_position_embeddings", 2048)), int(config["vocab_size"]), special


def layout_config(layout: str, model: Path, te_options: dict, colocated_tes: int) -> NodeConfig:
    if layout == "colocated":
        tes = tuple(TESpec(f"te{i}", "colocated", te_options) for i in range(colocated_tes))
        pd_policy, policy = None, "load"
    else:
        tes = (TESpec("te0", "prefill", te_options | {"kv_transfer_layerwise": True}),
               TESpec("te1", "decode", te_options))
        pd_policy, policy = "disaggregated", "combined"
    return NodeConfig.build(model=str(model), served_model="profile", port=free_port(),
                            policy=policy, pd_policy=pd_policy, startup_timeout_s=300,
                            te_timeout_s=60, request_timeout_s=600.0, tes=tes)


async def run_batch(url: str, prompts: list[list[int]], max_tokens: int, rate: float,
                    arrivals: str, seed: int, timeout_s: float) -> list:
    """Send each prompt at its arrival time; returns bench_serve RequestResults."""
    bench = bench_serve_module()
    target = bench.Target(url, "profile", None, timeout_s, {"temperature": 0.0})
    rng = random.Random(seed)
    t0 = time.perf_counter()
    results, tasks, at = [], [], 0.0
    for i, ids in enumerate(prompts):
        if i:
            at += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        result = bench.RequestResult(f"req{i}", 0, start_s=time.perf_counter() - t0)
        results.append(result)
        tasks.append(asyncio.create_task(
            bench.send(target, {"prompt": ids, "max_tokens": max_tokens}, [], result)))
    await asyncio.gather(*tasks)
    return results


def summarize_batch(results: list) -> dict:
    ok = [r for r in results if r.ok]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return {"num_ok": len(ok), "num_failed": len(results) - len(ok),
            "mean_jct_s": mean([r.e2e_s for r in ok]),
            "mean_ttft_s": mean([r.ttft_s for r in ok if r.ttft_s is not None]),
            "mean_tpot_s": mean([r.tpot_s for r in ok if r.tpot_s is not None]),
            "mean_completion_tokens": mean([r.completion_tokens for r in ok]),
            "errors": [{"request": r.session, "status": r.status, "error": r.error}
                       for r in results if not r.ok]}


def make_prompts(rng: random.Random, n: int, length: int, vocab: int, special: set[int]):
    allowed = [t for t in range(vocab) if t not in special]
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(n)]


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", type=click.Path(exists=True, file_okay=False), default="models/tiny")
@click.option("--out", type=click.Path(dir_okay=False), default="conf/pd_heatmap.json")
@click.option("--raw-out", type=click.Path(dir_okay=False), default=None,
              help="per (cell, rate, layout) measurements as JSON")
@click.option("--prompt-lens", default="128,512,1024,1536", help="prompt lengths (tokens)")
@click.option("--ratios", default="0.03125,0.125,0.5,1", help="decode/prompt ratios")
@click.option("--rates", default="2,8,24", help="request rates (req/s), one map each")
@click.option("--requests-per-cell", default=12, help="requests per (cell, rate, layout)")
@click.option("--arrivals", type=click.Choice(["fixed", "poisson"]), default="fixed")
@click.option("--colocated-tes", default=1, help="colocated TEs in layout A (1 or 2)")
@click.option("--threads", default=1, help="torch threads per TE worker")
@click.option("--dtype", default=None, help="TE dtype (default: the model's)")
@click.option("--warmup", default=2, help="warm-up requests per layout before measuring")
@click.option("--seed", default=0)
@click.option("--quick", is_flag=True,
              help="smoke run: prompt lens 128,1024, ratios 0.0625,0.5, rate 2, 3 requests")
def main(model, out, raw_out, prompt_lens, ratios, rates, requests_per_cell, arrivals,
         colocated_tes, threads, dtype, warmup, seed, quick):
    if quick:
        prompt_lens, ratios, rates, requests_per_cell = "128,1024", "0.0625,0.5", "2", 3
    model = Path(model).resolve()
    plens = sorted(int(x) for x in prompt_lens.split(","))
    rlist = sorted(float(x) for x in ratios.split(","))
    rate_list = [float(x) for x in rates.split(",")]
    context, vocab, special = model_limits(model)
    te_options = {"num_threads": threads, "max_num_batched_tokens": 512,
                  "kv_cache_memory": 256 << 20}
    if dtype:
        te_options["dtype"] = dtype
    p_edges, r_edges = edges_of(plens, True), edges_of(rlist, False)
    fair = (f"layout A = {colocated_tes} colocated TE(s), layout B = 1 prefill + 1 decode TE; "
            f"{threads} torch thread(s) per TE worker on {os.cpu_count()} CPU core(s)")
    if colocated_tes < 2:
        fair += " (B uses 2 processes to A's 1: on a small machine B has more CPU)"
    print(f"profile_pd: {fair}; load average at start {load_avg()}", flush=True)
    cells = [(i, j, p, r, max(1, round(p * r))) for i, p in enumerate(plens)
             for j, r in enumerate(rlist)]
    nodes: dict[str, Node] = {}
    raw: list[dict] = []
    started = time.monotonic()
    try:
        for layout in LAYOUTS:
            t = time.monotonic()
            node = Node(layout_config(layout, model, te_options, colocated_tes))
            nodes[layout] = node  # before start(): a failed start stops itself, stop() is idempotent
            node.start()
            print(f"node {layout} up at {node.url} in {time.monotonic() - t:.1f} s", flush=True)
            wrng = random.Random(seed + 999)
            warm = asyncio.run(run_batch(node.url, make_prompts(wrng, warmup, 256, vocab, special),
                                         32, 4.0, "fixed", 0, 300))
            bad = [r for r in warm if not r.ok]
            if bad:
                raise RuntimeError(f"warm-up failed on {layout}: "
                                   f"{[(r.session, r.status, r.error) for r in bad]}")
        print(f"{'p':>5} {'d':>5} {'rate':>5} | {'JCT A s':>8} {'JCT B s':>8} | "
              f"{'out A':>6} {'out B':>6} | {'TTFT A':>7} {'TTFT B':>7} | value", flush=True)
        per_rate = {rate: [[None] * len(rlist) for _ in plens] for rate in rate_list}
        flip = False
        for i, j, p, r, d in cells:
            if p + d > context:
                print(f"{p:>5} {d:>5}   -   | skipped: p + d = {p + d} > context {context}")
                continue
            for k, rate in enumerate(rate_list):
                rng = random.Random(hash((seed, p, d, k)) & 0xFFFFFFFF)
                prompts = make_prompts(rng, requests_per_cell, p, vocab, special)
                order = LAYOUTS[::-1] if flip else LAYOUTS
                flip = not flip
                row = {}
                for layout in order:
                    results = asyncio.run(run_batch(nodes[layout].url, prompts, d, rate,
                                                    arrivals, seed + k, 600))
                    row[layout] = summarize_batch(results)
                    for e in row[layout]["errors"]:
                        print(f"  ERROR {layout} p={p} d={d} rate={rate:g} {e}", flush=True)
                    dead = nodes[layout].dead()
                    if dead:
                        raise RuntimeError(f"node {layout}: process(es) died: {dead}")
                a, b = row["colocated"], row["disaggregated"]
                value = None
                if a["mean_jct_s"] and b["mean_jct_s"]:
                    value = a["mean_jct_s"] / b["mean_jct_s"] - 1
                    per_rate[rate][i][j] = round(value, 4)
                short = any(x["mean_completion_tokens"] is not None
                            and x["mean_completion_tokens"] < 0.9 * d for x in (a, b))
                raw.append({"prompt_len": p, "decode_len": d, "ratio": r, "rate": rate,
                            "order": list(order), "value": value, **row})
                f = (lambda x, n=2: "-" if x is None else f"{x:.{n}f}")
                print(f"{p:>5} {d:>5} {rate:>5g} | {f(a['mean_jct_s']):>8} "
                      f"{f(b['mean_jct_s']):>8} | {f(a['mean_completion_tokens'], 0):>6} "
                      f"{f(b['mean_completion_tokens'], 0):>6} | {f(a['mean_ttft_s']):>7} "
                      f"{f(b['mean_ttft_s']):>7} | {'-' if value is None else f'{value:+.2f}'}"
                      f"{'  (outputs short of d: EOS)' if short else ''}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: stopping the nodes", file=sys.stderr)
        raise
    finally:
        for node in nodes.values():
            node.stop()
    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    maps = [Heatmap(p_edges, r_edges, per_rate[rate], model=model.name,
                    source="tools/profile_pd.py", rates=[rate], created=created)
            for rate in rate_list]
    heatmap = Heatmap.combine(maps)
    heatmap.notes = (
        f"Measured on {model.name}: prompt lens {plens} x d/p ratios {rlist} (d = round(p*r)), "
        f"{requests_per_cell} requests per cell and rate, {arrivals} arrivals at {rate_list} "
        f"req/s, temperature 0, random-token prompts, no ignore_eos (gateway lacks it). "
        f"Cell = sum over rates of mean JCT(colocated)/mean JCT(1P1D) - 1. {fair}. "
        f"Null: p + d > context {context} or not measured. Load average at end {load_avg()}; "
        f"run took {time.monotonic() - started:.0f} s.")
    heatmap.save(out)
    if raw_out:
        Path(raw_out).write_text(json.dumps(raw, indent=1))
    print()
    for rate, m in zip(rate_list, maps):
        print(f"rate {rate:g} req/s:\n{m.to_grid_text()}\n")
    print(heatmap.to_grid_text())
    print(f"\nwrote {out} ({time.monotonic() - started:.0f} s; {fair})")


if __name__ == "__main__":
    main()
