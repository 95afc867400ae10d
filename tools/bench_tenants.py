"""Does a light tenant keep its latency while another floods? (issue 26)

    python tools/bench_tenants.py --model models/mini --duration 30 --rounds 2 --json OUT

Starts a node (one colocated TE running at most --te-slots requests at once,
so that what waits, waits in the job executor's fair queue) with two API
keys: tenant A and tenant B. Rounds alternate two phases of --duration s:

  alone  B sends --b-rate requests/s (open loop, streamed) and nobody else;
  flood  B as before while A sends --flood-factor x B's rate, or, with
         --a-streams N, while A keeps N streams open (closed loop: each one
         sends its next request when the last ended).

    python tools/bench_tenants.py --model models/smollm2-135m-instruct --a-streams 24 \
        --te-count 2 --te-slots 256 --te-option max_num_batched_tokens=512 \
        --te-option kv_cache_memory=134217728 --max-tokens 64

is the default conf/node.toml's TEs with A holding 24 streams (issue 47).

It reports B's TTFT p50 / p99 alone and under the flood, their ratios, and
A's completed requests/s and tokens/s under the flood (A must still use the
capacity B leaves idle); per round, and the median (min-max) over rounds.
A's requests still open when a flood phase ends are cancelled (the gateway
aborts them, the JE drops them from its queue) before the next phase.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
import statistics
import sys
import time
import tomllib
from pathlib import Path

import click
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import RequestResult, Target, make_client, send  # noqa: E402
from bench_stats import percentile  # noqa: E402

from deepserve.config.tenants import TenantsSection  # noqa: E402
from deepserve.ipc.sockets import free_port  # noqa: E402
from deepserve.supervisor.node import Node  # noqa: E402
from deepserve.supervisor.node_config import NodeConfig, TESpec  # noqa: E402

KEYS = {"key-a": "A", "key-b": "B"}
PROMPT = "Tell me a short story about a tenant who waited in line. " * 4


async def _open_loop(target: Target, rate: float, duration_s: float, max_tokens: int,
                     tag: str, t0: float, results: list[RequestResult]) -> None:
    """Requests at `rate`/s for duration_s, into results; returns when all
    started ones ended, or is cancelled (then cancels them: their streams close)."""
    tasks = []
    async with make_client(target) as client:
        n = 0
        while time.perf_counter() - t0 < duration_s:
            r = RequestResult(tag, n, start_s=time.perf_counter() - t0)
            results.append(r)
            tasks.append(asyncio.create_task(send(
                target, {"prompt": f"{n} {PROMPT}", "max_tokens": max_tokens}, [], r, client)))
            n += 1
            await asyncio.sleep(max(0.0, t0 + n / rate - time.perf_counter()))
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


async def _closed_loop(target: Target, streams: int, duration_s: float, max_tokens: int,
                       tag: str, t0: float, results: list[RequestResult]) -> None:
    """`streams` requests open at once for duration_s, each followed by the
    next as it ends; cancelled: their streams close."""
    async with make_client(target) as client:
        async def one_stream(k: int) -> None:
            n = 0
            while time.perf_counter() - t0 < duration_s:
                r = RequestResult(tag, k * 100000 + n, start_s=time.perf_counter() - t0)
                results.append(r)
                await send(target, {"prompt": f"{k}.{n} {PROMPT}", "max_tokens": max_tokens},
                           [], r, client)
                n += 1
        await asyncio.gather(*(one_stream(k) for k in range(streams)))


async def phase(url: str, flood: bool, args: dict) -> dict:
    b = Target(url, "bench", "key-b", 120.0, {"temperature": 0.0})
    a = Target(url, "bench", "key-a", 120.0, {"temperature": 0.0})
    t0 = time.perf_counter()
    duration, mt = args["duration"], args["max_tokens"]
    a_results: list[RequestResult] = []
    b_results: list[RequestResult] = []
    b_task = asyncio.create_task(_open_loop(b, args["b_rate"], duration, mt, "B", t0, b_results))
    if flood:  # A's leftovers are cancelled once B's phase is over
        a_task = asyncio.create_task(
            _closed_loop(a, args["a_streams"], duration, mt, "A", t0, a_results)
            if args["a_streams"] else
            _open_loop(a, args["b_rate"] * args["flood_factor"], duration, mt, "A", t0,
                       a_results))
        await asyncio.wait({b_task}, timeout=duration + args["grace"])
        a_task.cancel()
        await asyncio.gather(a_task, return_exceptions=True)
    await b_task
    elapsed = time.perf_counter() - t0
    ttfts = [r.ttft_s for r in b_results if r.ok and r.ttft_s is not None]
    a_ok = [r for r in a_results if r.ok]
    return {"phase": "flood" if flood else "alone", "seconds": round(elapsed, 2),
            "b_sent": len(b_results), "b_ok": len(ttfts),
            "b_failed": dict(Counter(f"{r.status} {(r.error or '')[:60]}"
                                     for r in b_results if not r.ok)),
            "b_ttft_p50_ms": _ms(percentile(ttfts, 50)), "b_ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "a_sent": len(a_results), "a_ok": len(a_ok),
            "a_rps": round(len(a_ok) / duration, 2) if flood else None,
            "a_tokens_per_s": round(sum(r.completion_tokens for r in a_ok) / duration, 1)
            if flood else None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def node_config(args: dict) -> NodeConfig:
    config = NodeConfig.build(model=str(args["model"]), served_model="bench", port=free_port(),
                              startup_timeout_s=300, te_timeout_s=60, api_keys=KEYS,
                              tes=tuple(TESpec(f"te{i}", "colocated",
                                               {"max_num_seqs": args["te_slots"],
                                                **dict(args["te_option"])})
                                        for i in range(args["te_count"])))
    return msgspec.structs.replace(config, tenants=TenantsSection())


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise click.BadParameter(f"{text!r}: KEY=VALUE")
    return key.strip(), tomllib.loads(f"v = {value}")["v"]


def _spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def summarize(rows: list[dict]) -> dict:
    alone = [r for r in rows if r["phase"] == "alone"]
    flood = [r for r in rows if r["phase"] == "flood"]
    ratios = {q: [f[f"b_ttft_{q}_ms"] / a[f"b_ttft_{q}_ms"]
                  for a, f in zip(alone, flood) if a[f"b_ttft_{q}_ms"] and f[f"b_ttft_{q}_ms"]]
              for q in ("p50", "p99")}
    return {"b_ttft_p50_ms_alone": _spread([r["b_ttft_p50_ms"] for r in alone]),
            "b_ttft_p50_ms_flood": _spread([r["b_ttft_p50_ms"] for r in flood]),
            "b_ttft_p99_ms_alone": _spread([r["b_ttft_p99_ms"] for r in alone]),
            "b_ttft_p99_ms_flood": _spread([r["b_ttft_p99_ms"] for r in flood]),
            "p50_ratio": _spread([round(x, 2) for x in ratios["p50"]]),
            "p99_ratio": _spread([round(x, 2) for x in ratios["p99"]]),
            "a_rps_flood": _spread([r["a_rps"] for r in flood]),
            "a_tokens_per_s_flood": _spread([r["a_tokens_per_s"] for r in flood])}


@click.command()
@click.option("--model", type=click.Path(exists=True, path_type=Path), default="models/mini")
@click.option("--duration", type=float, default=30.0, help="seconds per phase")
@click.option("--rounds", type=int, default=2, help="(alone, flood) pairs, interleaved")
@click.option("--b-rate", type=float, default=1.0, help="B's requests/s")
@click.option("--flood-factor", type=float, default=20.0, help="A's rate / B's rate")
@click.option("--max-tokens", type=int, default=16)
@click.option("--te-slots", type=int, default=4, help="the TE's max_num_seqs")
@click.option("--te-count", type=int, default=1, help="colocated TEs")
@click.option("--a-streams", type=int, default=0,
              help="A keeps this many streams open (closed loop) instead of --flood-factor")
@click.option("--te-option", multiple=True, callback=lambda c, p, v: [_option(o) for o in v],
              metavar="KEY=VALUE", help="another TE option, as in [[te]] (TOML value)")
@click.option("--grace", type=float, default=30.0, help="seconds past a phase for its requests")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
def main(**args):
    config = node_config(args)
    node = Node(config)
    rows = []
    try:
        t = time.monotonic()
        node.start()
        print(f"# node up in {time.monotonic() - t:.1f} s: {config.tes[0].options}; "
              f"B {args['b_rate']:g} rps, A "
              + (f"{args['a_streams']} streams" if args["a_streams"]
                 else f"{args['b_rate'] * args['flood_factor']:g} rps")
              + f" in floods, {args['duration']:g} s phases", flush=True)
        warm = RequestResult("warmup", 0)
        asyncio.run(send(Target(node.url, "bench", "key-b", 300.0), {"prompt": PROMPT,
                                                                   "max_tokens": 4}, [], warm))
        if not warm.ok:
            raise RuntimeError(f"warm-up failed: {warm.status} {warm.error}")
        for i in range(args["rounds"]):
            for flood in (False, True):
                rows.append({"round": i, **asyncio.run(phase(node.url, flood, args))})
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(2.0)  # aborted floods leave the queue
                dead = node.dead()
                if dead:
                    raise RuntimeError(f"process(es) died: {dead}")
    finally:
        node.stop()
    summary = summarize(rows)
    for key, value in summary.items():
        print(f"{key:24s} median {value['median']}  (min {value['min']}, max {value['max']})")
    if args["json_out"]:
        args["json_out"].write_text(json.dumps(
            {"args": {k: str(v) for k, v in args.items()}, "rounds": rows, "summary": summary},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
