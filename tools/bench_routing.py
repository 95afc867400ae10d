"""Routing benchmark: one node of two TEs per policy, the same traces and
rates against each, one table (the policies compared side by side in one run).

    python tools/bench_routing.py --model models/small --duration 60 \
        --traces agentic=/tmp/agentic.jsonl,chat=/tmp/chat.jsonl \
        --rates agentic=0.05:0.2,chat=0.2:1.0

Rates are open-loop arrivals per second (sessions per second for agentic
traces, whose turns then run back to back). Each TE gets --threads torch
threads so that two TEs share the cores instead of fighting over them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import click

from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("round_robin", "load", "locality", "combined")


def _bench_serve():
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "tools" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module
    spec.loader.exec_module(module)
    return module



def run_policy(policy, model, te_options, traces, rates, duration, grace, bench) -> list[dict]:
    config = NodeConfig.build(model=str(model), served_model="bench", port=free_port(),
                              policy=policy, startup_timeout_s=300, te_timeout_s=60,
                              tes=[TESpec(f"te{i}", "colocated", te_options) for i in range(2)])
    node = Node(config)
    node.start()
    rows = []
    try:
        for trace_name, trace in traces.items():
            for rate in rates[trace_name]:
                args = bench.parse_args(["--url", node.url, "--trace", str(trace), "--mode", "open",
                                         "--rate", str(rate), "--duration", str(duration),
                                         "--grace", str(grace), "--temperature", "0"])
                summary = asyncio.run(bench.run(args))["summary"]
                rows.append({"policy": policy, "trace": trace_name, "rate": rate, **summary})
                print(_line(rows[-1]), flush=True)
    finally:
        node.stop()
    return rows


def _ms(d: dict, key: str) -> str:
    value = (d or {}).get(key)
    return "-" if value is None else f"{value:.0f}"


def _line(r: dict) -> str:
    hit = "-" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.2f}"
    return " | ".join([r["trace"], f"{r['rate']:g}", r["policy"], f"{r['num_ok']}/{r['num_failed']}",
                       f"{r['request_throughput']:.3f}", f"{r['output_throughput']:.1f}",
                       _ms(r["ttft_ms"], "p50"), _ms(r["ttft_ms"], "p99"),
                       _ms(r["tpot_ms"], "p50"), _ms(r["tpot_ms"], "p99"), hit])


HEADER = ("trace | rate | policy | ok/failed | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | "
          "TPOT p50 ms | TPOT p99 ms | hit rate")


@click.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False), required=True)
@click.option("--traces", required=True, help="name=path,name=path")
@click.option("--rates", default="agentic=0.05:0.2,chat=0.2:1.0",
              help="per trace: name=low:high (arrivals per second)")
@click.option("--duration", default=60.0, help="seconds of arrivals per (trace, rate)")
@click.option("--grace", default=30.0, help="seconds for requests still running after that")
@click.option("--policies", default=",".join(POLICIES))
@click.option("--threads", default=1, help="torch threads per TE worker")
@click.option("--dtype", default="bfloat16")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def main(model, traces, rates, duration, grace, policies, threads, dtype, json_out):
    bench = _bench_serve()
    traces = dict(item.split("=", 1) for item in traces.split(","))
    rates = {name: [float(r) for r in values.split(":")]
             for name, values in (item.split("=", 1) for item in rates.split(","))}
    te_options = {"dtype": dtype, "num_threads": threads, "max_num_batched_tokens": 1024,
                  "kv_cache_memory": 1 << 30}
    print(HEADER, flush=True)
    rows = []
    for policy in policies.split(","):
        rows += run_policy(policy, model, te_options, traces, rates, duration, grace, bench)
    print("\n" + HEADER)
    for r in sorted(rows, key=lambda r: (r["trace"], r["rate"], POLICIES.index(r["policy"]))):
        print(_line(r))
    for r in rows:
        if r["errors"]:
            print(f"errors {r['policy']} {r['trace']} {r['rate']:g}: {r['errors']}")
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
