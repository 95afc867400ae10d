"""PD benchmark: a mixed trace (code: long prompts, short outputs + chat: short
prompts, longer outputs) replayed open-loop against two layouts x four routing
policies x low/medium/high rates, one table.

    python tools/bench_pd.py --model models/tiny [--rates 2,6,12] [--duration 30] \\
        [--policies round_robin,load,locality,algorithm1] [--layouts 2colo,colo+1p1d] \\
        [--json-out F] [--quick]

Layouts (one node each per policy, started once for all rates, always stopped):
  2colo       two colocated TEs
  colo+1p1d   one colocated TE + one prefill/decode pair (conf/pd.toml's layout)

Policies:
  round_robin, load, locality   the router policy of that name. In colo+1p1d
      the PD type is then chosen by --baseline-pd (default "threshold": the
      paper's rule of thumb, disaggregated when the prompt has >= 1024 tokens
      and the predicted decode length (conf/decode_predictor.json) is <= 128;
      "colocated" would leave the pair idle, "disaggregated" the colocated TE).
  algorithm1  DeepServe's Algorithm 1: router policy "combined" + pd_policy
      "heatmap" (--heatmap, default conf/pd_heatmap.json from
      tools/profile_pd.py, + the predictor).
In 2colo there are no PD TEs, so the PD choice is moot: no pd_policy is set
and algorithm1 is just the "combined" router policy.

The trace is made in-process with tools/traces.py (gen_code, gen_chat; token
counts with the model's tokenizer), shuffled with --seed, long enough that no
run reuses it (no --cycle, so no artificial prefix-cache hits); every run
gets the same records and Poisson arrival times (tools/bench_serve.py's Bench,
imported; temperature 0). Per (layout, policy, rate): request and output-token
throughput, p50/p99 TTFT and TPOT, mean JCT (end-to-end). Failed requests are
listed with their ids and error bodies.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import click

from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("2colo", "colo+1p1d")
POLICIES = ("round_robin", "load", "locality", "algorithm1")
PD_OPTIONS = {"margin": 0.0, "min_prompt_len": 1024, "max_decode_len": 128}  # conf/pd.toml's


def _import(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module



def make_trace(path: Path, model: Path, num: int, code_fraction: float, code_prompt, code_out,
               chat_prompt, chat_out, seed: int) -> dict:
    traces = _import("traces")
    rng, count = random.Random(seed), traces.make_counter(str(model))
    num_code = round(num * code_fraction)
    records = [*traces.gen_code(rng, num_code, code_prompt, code_out, count),
               *traces.gen_chat(rng, num - num_code, chat_prompt, chat_out, count)]
    random.Random(seed + 1).shuffle(records)
    traces.write_jsonl(records, path)
    return {"num_code": num_code, "num_chat": num - num_code,
            "mean_prompt_tokens_est": sum(r["prompt_tokens_est"] for r in records) / len(records),
            "mean_max_tokens": sum(r["max_tokens"] for r in records) / len(records)}


def node_config(layout: str, policy: str, model: Path, te_options: dict, baseline_pd: str,
                heatmap: str, predictor: str, port: int) -> tuple[NodeConfig, str]:
    """(config, PD label)."""
    router = "combined" if policy == "algorithm1" else policy
    kw: dict = {}
    if layout == "2colo":
        tes = tuple(TESpec(f"te{i}", "colocated", te_options) for i in range(2))
        pd = "-"
    else:
        tes = (TESpec("te0", "colocated", te_options),
               TESpec("te1", "prefill", te_options | {"kv_transfer_backend": "shm",
                                                      "kv_transfer_layerwise": True}),
               TESpec("te2", "decode", te_options))
        pd = "heatmap" if policy == "algorithm1" else baseline_pd
        kw = {"pd_policy": pd, "pd_options": PD_OPTIONS, "pd_predictor": predictor}
        if pd == "heatmap":
            kw["pd_heatmap"] = heatmap
    return NodeConfig.build(model=str(model), served_model="bench", port=port, policy=router,
                            startup_timeout_s=300, te_timeout_s=60, tes=tes, **kw), pd


def warm_up(bench, url: str) -> None:
    """Two small requests, so that first-request costs stay out of the numbers."""
    async def go():
        target = bench.Target(url, "bench", None, 120, {"temperature": 0.0})
        results = [bench.RequestResult(f"warmup{i}", 0) for i in range(2)]
        await asyncio.gather(
            bench.send(target, {"prompt": "def f(x):\n    return x" * 40, "max_tokens": 8}, [],
                       results[0]),
            bench.send(target, {"messages": [{"role": "user", "content": "Hello there."}],
                                "max_tokens": 8}, [{"role": "user", "content": "Hello there."}],
                       results[1]))
        bad = [(r.session, r.status, r.error) for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up failed: {bad}")
    asyncio.run(go())


def run_node(layout, policy, rates, names, model, te_options, args, trace, bench) -> list[dict]:
    config, pd = node_config(layout, policy, model, te_options, args["baseline_pd"],
                             args["heatmap"], args["predictor"], free_port())
    node = Node(config)
    rows = []
    try:
        t = time.monotonic()
        node.start()
        print(f"# node {layout} / {policy} (router {config.policy}, pd {pd}) up in "
              f"{time.monotonic() - t:.1f} s, load {os.getloadavg()[0]:.2f}", flush=True)
        warm_up(bench, node.url)
        for rate, name in zip(rates, names):
            argv = ["--url", node.url, "--trace", str(trace), "--mode", "open", "--rate",
                    str(rate), "--duration", str(args["duration"]), "--grace", str(args["grace"]),
                    "--temperature", "0", "--model", "bench", "--seed", str(args["seed"])]
            report = asyncio.run(bench.run(bench.parse_args(argv)))
            s = report["summary"]
            failed = [{"request": f"{r['session']}/turn{r['turn']}", "status": r["status"],
                       "start_s": round(r["start_s"], 3), "error": r["error"]}
                      for r in report["requests"] if not r["ok"]]
            rows.append({"layout": layout, "policy": policy, "router": config.policy, "pd": pd,
                         "rate": rate, "rate_name": name, "load_avg": os.getloadavg()[0],
                         **s, "failed_requests": failed})
            print(line(rows[-1]), flush=True)
            dead = node.dead()
            if dead:
                raise RuntimeError(f"node {layout}/{policy}: process(es) died: {dead}")
    finally:
        node.stop()
    return rows


def _ms(d: dict, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v:.0f}"


HEADER = ("layout | policy (router, pd) | rate | ok/fail | req/s | out tok/s | TTFT p50 | "
          "TTFT p99 | TPOT p50 | TPOT p99 | mean JCT ms | load")


def line(r: dict) -> str:
    return " | ".join([r["layout"], f"{r['policy']} ({r['router']}, {r['pd']})",
                       f"{r['rate_name']} {r['rate']:g}", f"{r['num_ok']}/{r['num_failed']}",
                       f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                       _ms(r["ttft_ms"], "p50"), _ms(r["ttft_ms"], "p99"),
                       _ms(r["tpot_ms"], "p50"), _ms(r["tpot_ms"], "p99"),
                       _ms(r["e2e_ms"], "mean"), f"{r['load_avg']:.1f}"])


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", type=click.Path(exists=True, file_okay=False), default="models/tiny")
@click.option("--rates", default="2,6,12", help="low,medium,high arrivals per second")
@click.option("--duration", default=30.0, help="seconds of arrivals per run")
@click.option("--grace", default=30.0, help="seconds for requests still running after that")
@click.option("--layouts", default=",".join(LAYOUTS))
@click.option("--policies", default=",".join(POLICIES))
@click.option("--baseline-pd", type=click.Choice(["threshold", "colocated", "disaggregated"]),
              default="threshold", help="PD choice of round_robin/load/locality in colo+1p1d")
@click.option("--heatmap", default=str(ROOT / "conf" / "pd_heatmap.json"))
@click.option("--predictor", default=str(ROOT / "conf" / "decode_predictor.json"))
@click.option("--code-fraction", default=0.3, help="share of code requests in the trace")
@click.option("--threads", default=1, help="torch threads per TE worker")
@click.option("--dtype", default=None)
@click.option("--seed", default=0)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.option("--quick", is_flag=True, help="smoke run: medium rate only, round_robin and "
              "algorithm1, 15 s runs (~3 min)")
def main(model, rates, duration, grace, layouts, policies, baseline_pd, heatmap, predictor,
         code_fraction, threads, dtype, seed, json_out, quick):
    rate_list = [float(x) for x in rates.split(",")]
    names = ["low", "medium", "high"] if len(rate_list) == 3 else [f"r{i}" for i in
                                                                   range(len(rate_list))]
    if quick:
        mid = len(rate_list) // 2
        rate_list, names = [rate_list[mid]], [names[mid]]
        policies, duration, grace = "round_robin,algorithm1", 15.0, 15.0
    model = Path(model).resolve()
    context = json.loads((model / "config.json").read_text()).get("max_position_embeddings", 2048)
    # code prompts long but within the context with their outputs; >= 1024 so that the
    # threshold baseline sends them disaggregated
    code_prompt = (1080, min(1650, context - 200))  # actual: ~40 fewer tokens
    te_options = {"num_threads": threads, "max_num_batched_tokens": 512,
                  "kv_cache_memory": 256 << 20}
    if dtype:
        te_options["dtype"] = dtype
    bench = _import("bench_serve")
    args = {"baseline_pd": baseline_pd, "heatmap": heatmap, "predictor": predictor,
            "duration": duration, "grace": grace, "seed": seed}
    num = math.ceil(max(rate_list) * duration * 1.6) + 20  # Poisson: a margin over rate x duration
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_pd-") as tmp:
        trace = Path(tmp) / "mixed.jsonl"
        info = make_trace(trace, model, num, code_fraction, code_prompt, (16, 64), (20, 80),
                          (64, 256), seed)
        print(f"# trace: {info['num_code']} code (prompt {code_prompt[0]}-{code_prompt[1]} tok, "
              f"16-64 out) + {info['num_chat']} chat (20-80 tok, 64-256 out), mean prompt "
              f"~{info['mean_prompt_tokens_est']:.0f} tok, mean max_tokens "
              f"{info['mean_max_tokens']:.0f}; {os.cpu_count()} cores, {threads} thread(s)/TE, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        print(HEADER, flush=True)
        rows: list[dict] = []
        try:
            for layout in layouts.split(","):
                for policy in policies.split(","):
                    rows += run_node(layout, policy, rate_list, names, model, te_options, args,
                                     trace, bench)
        except KeyboardInterrupt:
            print("interrupted: the node was stopped; partial results follow", file=sys.stderr)
        finally:
            order = {n: i for i, n in enumerate(names)}
            print(f"\n# {len(rows)} runs in {time.monotonic() - started:.0f} s\n{HEADER}")
            for r in sorted(rows, key=lambda r: (order[r["rate_name"]], r["layout"],
                                                 POLICIES.index(r["policy"]))):
                print(line(r))
            for r in rows:
                for f in r["failed_requests"][:20]:
                    print(f"FAILED {r['layout']}/{r['policy']}/{r['rate']:g}: {f}")
            if json_out:
                Path(json_out).write_text(json.dumps({"trace": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
