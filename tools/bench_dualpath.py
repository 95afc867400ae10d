"""DualPath on one node: PE-only loading, DualPath, and an oracle without
storage limits, side by side on an agent trace shaped like DualPath's Table 2.

    python tools/bench_dualpath.py [--model models/tiny] [--agents 12 | --window-s 30] [--turns 6]
        [--context 1200] [--append 40-80] [--max-tokens 12] [--storage-gbps 0.01] [--host-mib 4]
        [--rates 0.25,0.5,1,2] [--rounds 2] [--slo-s 20] [--png dualpath.png] [--json out.json]
    python tools/bench_dualpath.py --offline [--rounds 3] [--json rows.json] [...]

The node is conf/dualpath.toml (2 prefill + 2 decode TEs, the disk tier as
the KV storage, a storage_read_gbps bucket per TE) with prefill pools that
hold about one agent's context (--device-blocks), decode pools that hold
several (--decode-blocks: the scheduler sends a decode TE only what fits, so
a small one serializes the batch and binds before storage does), and a host
tier of about a third of the agents' working set (--host-mib), so most turns'
contexts come back from storage (Table 2's shape scaled to this machine:
long contexts, short appends, many turns, a high hit rate). These defaults
are the storage-bound regime conf/dualpath.toml describes: PE-only's prefill
engines idle on their read queues. In every mode a prefill TE reads the disk
hits of a request waiting for room in its pool ahead, into its buffer
(conf/dualpath.toml's prefill kv_stream_bytes: the paper's PE buffer).

Modes (one node each, one at a time):
  pe_only   [router] dualpath.read_paths = "prefill": the prefill TE always reads
  dualpath  the scheduler picks the side with the shorter storage read queue; a
            decode TE streams what it reads to the prefill TE a layer at a time
            (conf/dualpath.toml: dualpath_hop = "stream", transfer/layer_stream.py)
  oracle    dualpath with no storage_read_gbps: storage I/O costs no bandwidth
  dualpath_host (only with --modes): dualpath with the older hop on one node, the
            decode TE staging the blocks in the host tier (engine/tiers/staging.py),
            pinned there until the prefill TE has them, up to half of it
An agent is a session of --turns turns: turn 1 sends its context, every later
turn the whole trajectory so far (the replies included) plus an append.
Agents arrive open-loop (Poisson, --rates agents/s, same seeded trace for
every mode); JCT is an agent's first request to its last reply. Per mode and
rate: median / p90 JCT, agents/s completed, the cache hit rate (cached /
prompt tokens over every turn, and over turns 2+: DualPath's 98.7% is 1 -
append / context, a later turn's, so it leaves out turn 1's context, which
nothing can hold yet; its ceiling, what a cache that kept every full block
could hold), storage bytes read per path, and the storage load
balance (max / mean bytes read over the four TEs). "Agents/s at the SLO" is
the highest rate whose p90 JCT stays within --slo-s, and, finer, the rate at
which p90 JCT first passes it (linear between the two rates around it).
With a fixed --agents a high rate is one burst (36 agents at 8/s arrive in
4.5 s) and the SLO then bounds that burst's completion; --window-s W sends
rate x W agents instead, a load held for W seconds, where the SLO bounds
the rate a node sustains.
Rounds interleave the modes (pe_only, dualpath, oracle, pe_only, ...);
tables are medians over rounds.

--offline is DualPath's rollout experiment: the same fixed batch of agents
all start at once and run to completion; jct_s is the batch's completion
time. --json then writes a list of rows, one per mode and round (mode,
round, jct_s, ...). At its defaults (storage bandwidth OFFLINE_GBPS) PE-only's
read queues stay long while the CPUs idle (conf/dualpath.toml); every row
carries the evidence, sampled each 0.5 s during the run: the machine's mean
CPU use (cpu_busy_pct) and the TEs' summed storage read queues
(read_queue_tokens_mean), and what the TEs' lookups below the device came to
(tier_lookups: deepserve_tier_lookups_total).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import psutil
from prometheus_client.parser import text_string_to_metric_families

from deepserve.config.engine import EngineConfig
from deepserve.config.loading import load_node_config
from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is no package
from bench_stats import percentile  # noqa: E402
import traces  # noqa: E402

MODES = ("pe_only", "dualpath", "oracle")  # the default --modes
ALL_MODES = ("pe_only", "dualpath", "dualpath_host", "oracle")
HOST_HOP = {"kv_stream_bytes": 0, "dualpath_hop": "auto"}  # dualpath_host's decode TEs
ONLINE_GBPS = 0.01
OFFLINE_GBPS = 0.005  # PE-only's read queues stay long while the CPUs idle (conf/dualpath.toml)


def node_config(mode: str, args, disk: Path):
    config = load_node_config(ROOT / "conf" / "dualpath.toml", {
        "port": free_port(), "model": str(args.model), "served_model": "m",
        "host_cache_bytes": int(args.host_mib * (1 << 20)), "disk_cache_dir": str(disk)})
    gbps = None if mode == "oracle" else args.storage_gbps
    tes = tuple(msgspec.structs.replace(te, options={
        **te.options, "storage_read_gbps": gbps, "num_kv_blocks":
            args.decode_blocks if te.te_type == "decode" else args.device_blocks,
        **(HOST_HOP if mode == "dualpath_host" and te.te_type == "decode" else {})})
        for te in config.tes)
    dualpath = msgspec.structs.replace(config.router.dualpath,
                                       read_paths="prefill" if mode == "pe_only" else "both")
    router = msgspec.structs.replace(config.router, dualpath=dualpath)
    sup = msgspec.structs.replace(config.supervisor, log_dir=str(disk.parent / "logs"))
    return msgspec.structs.replace(config, tes=tes, router=router, supervisor=sup)


def agents(args, seed: int, rate: float | None = None) -> list[list[list[int]]]:
    """Per agent: its context, then each later turn's append (token ids);
    --agents of them, or with --window-s, as many as arrive at `rate` in it."""
    rng = random.Random(seed)
    out = []
    count = round(rate * args.window_s) if rate and args.window_s else args.agents
    for _ in range(count):
        first = [rng.randrange(100, 1900) for _ in range(args.context)]
        appends = [[rng.randrange(100, 1900) for _ in range(rng.randint(*args.append))]
                   for _ in range(args.turns - 1)]
        out.append([first] + appends)
    return out


async def run_agent(client, url: str, turns, max_tokens: int, delay: float,
                    block_size: int) -> dict:
    """One agent's turns in order; per turn its prompt and cached tokens, and
    what a cache that kept everything could hold of it (cacheable: the full
    blocks of the trajectory so far, whose last token's KV no step computed)."""
    await asyncio.sleep(delay)
    t0, ids, prompt, cached, cacheable, error = time.perf_counter(), [], [], [], [], None
    for append in turns:
        cacheable.append(max(0, len(ids) - 1) // block_size * block_size)
        ids = ids + append
        body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        r = None
        try:
            r = (await client.post(f"{url}/v1/completions", json=body, timeout=600)).json()
            out = [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
        except (httpx.HTTPError, KeyError, ValueError) as e:  # the first failure ends the agent
            reply = r.get("error") if isinstance(r, dict) else None
            error = reply.get("message") if isinstance(reply, dict) else f"{type(e).__name__}: {e}"
            break
        prompt.append(r["usage"]["prompt_tokens"])
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        ids = ids + out
    return {"jct": time.perf_counter() - t0, "ok": error is None, "error": error,
            "prompt": sum(prompt), "cached": sum(cached),  # every turn, and turns 2+:
            "prompt_later": sum(prompt[1:]), "cached_later": sum(cached[1:]),
            "cacheable_later": sum(cacheable[1:len(prompt)])}


async def run_load(url: str, trace, rate: float | None, max_tokens: int, seed: int,
                   block_size: int) -> tuple[list[dict], dict]:
    """Every agent of the trace (Poisson arrivals at `rate`; None: all at once,
    the offline batch), and what the machine did meanwhile (sample_load)."""
    rng, t, delays = random.Random(seed), 0.0, []
    for _ in trace:
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        sampler = asyncio.create_task(sample_load(client, url))
        results = await asyncio.gather(*(run_agent(client, url, a, max_tokens, d, block_size)
                                         for a, d in zip(trace, delays)))
        sampler.cancel()
        return results, await sampler


async def sample_load(client, url: str, every_s: float = 0.5) -> dict:
    """Until cancelled: the machine's CPU use and the TEs' storage read queues
    (deepserve_storage_read_queue_tokens, summed), every every_s. Storage
    binds where the queues stay long while the CPUs idle."""
    cpu, queue = [], []
    psutil.cpu_percent(None)
    try:
        while True:
            await asyncio.sleep(every_s)
            cpu.append(psutil.cpu_percent(None))
            try:
                text = (await client.get(f"{url}/metrics", timeout=5)).text
            except httpx.HTTPError:
                continue
            queue.append(sum(s.value for fam in text_string_to_metric_families(text)
                             for s in fam.samples
                             if s.name == "deepserve_storage_read_queue_tokens"))
    except asyncio.CancelledError:
        return {"cpu_busy_pct": statistics.mean(cpu) if cpu else None,
                "read_queue_tokens_mean": statistics.mean(queue) if queue else None}


def storage_reads(url: str) -> dict[tuple[str, str], float]:
    """(te id, path) -> storage bytes read, ("hits", tier) -> cached tokens by
    tier, ("decisions", path) -> requests by DualPath's read path,
    ("lookups", outcome) -> the TEs' lookups below the device by outcome."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "deepserve_storage_read_bytes_total":
                out[(s.labels["te_id"], s.labels["path"])] = s.value
            elif s.name == "deepserve_dualpath_decisions_total":
                out[("decisions", s.labels["path"])] = s.value
            elif s.name == "deepserve_cache_hit_tokens_total":
                out[("hits", s.labels["tier"])] = s.value
            elif s.name == "deepserve_tier_lookups_total":
                out[("lookups", s.labels["outcome"])] = s.value
    return out


def block_size(node: Node) -> int:
    sizes = {te.options.get("block_size", EngineConfig.block_size) for te in node.config.tes}
    assert len(sizes) == 1, sizes  # one prefix cache, one block size
    return sizes.pop()


def run_mode(mode: str, args, rate: float | None, seed: int) -> dict:
    """One node in `mode` serving the seeded agents at `rate` (None: offline,
    all at once; jct_s is then the whole batch's completion time)."""
    with tempfile.TemporaryDirectory(prefix="dpstore") as tmp:
        disk = Path(tmp) / "storage"
        node = Node(node_config(mode, args, disk))
        try:  # an interrupt while it starts stops it too (its /dev/shm weight cache)
            node.start()
            before = storage_reads(node.url)
            started = time.perf_counter()
            results, load = asyncio.run(run_load(node.url, agents(args, seed, rate), rate,
                                                 args.max_tokens, seed, block_size(node)))
            wall = time.perf_counter() - started
            time.sleep(1.5)  # the last TEReports reach the gateway
            after = storage_reads(node.url)
        finally:
            node.stop()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    hits = {tier: v for (kind, tier), v in delta.items() if kind == "hits"}
    decisions = {path: v for (kind, path), v in delta.items() if kind == "decisions"}
    lookups = {outcome: v for (kind, outcome), v in delta.items() if kind == "lookups"}
    reads = {k: v for k, v in delta.items() if k[0] not in ("hits", "decisions", "lookups")}
    per_te: dict[str, float] = {}
    for (te, _), v in reads.items():
        per_te[te] = per_te.get(te, 0) + v
    loads = [per_te.get(te.te_id, 0.0) for te in node.config.tes]
    ok = [r for r in results if r["ok"]]
    errors = sorted({r["error"] for r in results if not r["ok"]})
    jcts = [r["jct"] for r in ok]
    return {"mode": mode, "rate": rate, "seed": seed, "wall_s": wall, "agents_ok": len(ok),
            "agents_failed": len(results) - len(ok), "errors": errors[:3],
            "agents_per_s": len(ok) / wall,
            "jct_p50_s": percentile(jcts, 50), "jct_p90_s": percentile(jcts, 90),
            "hit_rate": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
            "hit_rate_later_turns": sum(r["cached_later"] for r in ok)
            / max(1, sum(r["prompt_later"] for r in ok)),
            "hit_ceiling_later_turns": sum(r["cacheable_later"] for r in ok)
            / max(1, sum(r["prompt_later"] for r in ok)),
            "bytes_prefill_path": sum(v for (_, p), v in reads.items() if p == "prefill"),
            "bytes_decode_path": sum(v for (_, p), v in reads.items() if p == "decode"),
            "balance_max_over_mean": max(loads) / statistics.mean(loads) if any(loads) else None,
            "bytes_per_te": per_te, "hit_tokens_by_tier": hits, "decisions": decisions,
            "tier_lookups": lookups,
            **load}


def med(rows: list[dict], key: str):
    values = [r[key] for r in rows if r[key] is not None]
    return (statistics.median(values), min(values), max(values)) if values else (None,) * 3


def table(runs: list[dict], args) -> str:
    lines = ["| mode | rate (agents/s) | JCT p50 (s) | JCT p90 (s) | agents/s done | hit rate | "
             "MB prefill path | MB decode path | balance max/mean | failed |",
             "|" + "---|" * 10]
    for rate in args.rates:
        for mode in args.modes:
            rows = [r for r in runs if r["mode"] == mode and r["rate"] == rate]
            if not rows:
                continue
            p50 = med(rows, "jct_p50_s")
            bal = med(rows, "balance_max_over_mean")[0]
            lines.append(
                f"| {mode} | {rate:g} | {p50[0]:.2f} ({p50[1]:.2f}-{p50[2]:.2f}) | "
                f"{med(rows, 'jct_p90_s')[0]:.2f} | {med(rows, 'agents_per_s')[0]:.3f} | "
                f"{100 * med(rows, 'hit_rate')[0]:.1f}% | "
                f"{med(rows, 'bytes_prefill_path')[0] / 1e6:.1f} | "
                f"{med(rows, 'bytes_decode_path')[0] / 1e6:.1f} | "
                f"{'-' if bal is None else f'{bal:.2f}'} | "
                f"{sum(r['agents_failed'] for r in rows)} |")
    lines.append("")
    for mode in args.modes:
        p90 = [(rate, m) for rate in sorted(args.rates)
               if (m := med([r for r in runs if r["mode"] == mode and r["rate"] == rate],
                            "jct_p90_s")[0]) is not None]
        within = [rate for rate, m in p90 if m <= args.slo_s]
        lines.append(f"{mode}: agents/s at the SLO (p90 JCT <= {args.slo_s:g} s): "
                     f"{max(within) if within else 'none of the rates'}; "
                     f"where p90 first crosses it: {_fmt(slo_crossing(p90, args.slo_s), '{:.2f}')}")
    return "\n".join(lines)


def slo_crossing(p90: list[tuple[float, float]], slo_s: float) -> float | None:
    """The rate at which p90 JCT first passes slo_s, interpolated linearly
    between the grid's rates (None: within it at every rate, or at none)."""
    for (r0, p0), (r1, p1) in zip(p90, p90[1:]):
        if p0 <= slo_s < p1:
            return r0 + (slo_s - p0) * (r1 - r0) / (p1 - p0)
        if p0 > slo_s:
            return None
    return None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def offline_table(runs: list[dict]) -> str:
    """One row per mode (medians over rounds, min-max), then the JCT ratios
    taken round by round."""
    lines = ["| mode | JCT (s) | CPU busy | read queue (tokens, mean) | hit rate | "
             "hit rate, turns 2+ (ceiling) | MB prefill path | MB decode path | "
             "decode-path requests | failed |", "|" + "---|" * 10]
    for mode in ALL_MODES:
        rows = [r for r in runs if r["mode"] == mode]
        if not rows:
            continue
        jct, cpu, queue = med(rows, "jct_s"), med(rows, "cpu_busy_pct"), med(
            rows, "read_queue_tokens_mean")
        decode = statistics.median(r["decisions"].get("decode", 0) for r in rows)
        lines.append(  # a batch shorter than one sample has no CPU or queue figure
            f"| {mode} | {jct[0]:.2f} ({jct[1]:.2f}-{jct[2]:.2f}) | {_fmt(cpu[0], '{:.0f}%')} | "
            f"{_fmt(queue[0], '{:.0f}')} | {100 * med(rows, 'hit_rate')[0]:.1f}% | "
            f"{100 * med(rows, 'hit_rate_later_turns')[0]:.1f}% "
            f"({100 * med(rows, 'hit_ceiling_later_turns')[0]:.1f}%) | "
            f"{med(rows, 'bytes_prefill_path')[0] / 1e6:.1f} | "
            f"{med(rows, 'bytes_decode_path')[0] / 1e6:.1f} | {decode:.0f} | "
            f"{sum(r['agents_failed'] for r in rows)} |")
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["mode"]] = r["jct_s"]
    for a, b in (("pe_only", "dualpath"), ("dualpath", "oracle"),
                 ("pe_only", "dualpath_host"), ("dualpath_host", "dualpath")):
        ratios = [m[a] / m[b] for m in by_round.values() if a in m and b in m]
        if ratios:
            lines.append(f"JCT {a} / {b}: median {statistics.median(ratios):.2f} "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} rounds")
    return "\n".join(lines)


def plot(runs: list[dict], args, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("--png needs matplotlib: pip install -e '.[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in args.modes:
        xs, ys = [], []
        for rate in args.rates:
            v = med([r for r in runs if r["mode"] == mode and r["rate"] == rate], "jct_p50_s")[0]
            if v is not None:
                xs.append(rate)
                ys.append(v)
        ax.plot(xs, ys, marker="o", label=mode)
    ax.axhline(args.slo_s, color="grey", linestyle=":", label=f"SLO p90 {args.slo_s:g} s")
    ax.set_xlabel("offered load (agents/s)")
    ax.set_ylabel("median JCT (s)")
    ax.set_title(f"DualPath on one node: 2P2D, {args.storage_gbps:g} GB/s storage per TE")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    ap.add_argument("--agents", type=int, default=12)
    ap.add_argument("--window-s", type=float, default=None,
                    help="online: rate x this many agents per rate, not --agents (a load "
                    "held this long, where a fixed count at a high rate is one burst)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--context", type=int, default=1200)
    ap.add_argument("--append", type=traces.parse_range, default=(40, 80))
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--device-blocks", type=int, default=160,
                    help="a prefill TE's pool: about one context, so hits come from below")
    ap.add_argument("--decode-blocks", type=int, default=768,
                    help="a decode TE's pool (the scheduler sends a decode TE only what fits: "
                    "160 blocks take one context at a time, and then bind before storage)")
    ap.add_argument("--host-mib", type=float, default=16.0,
                    help="the node's host tier: the decode engines' staging buffer, and a cache")
    ap.add_argument("--storage-gbps", type=float, default=None,
                    help=f"per TE (default {ONLINE_GBPS:g}; --offline: {OFFLINE_GBPS:g})")
    ap.add_argument("--offline", action="store_true",
                    help="a fixed batch of agents, all at once, run to completion per mode")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slo-s", type=float, default=20.0)
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                    help=f"comma-separated, in the order each round runs them: {ALL_MODES}")
    args = ap.parse_args(argv)
    unknown = [m for m in args.modes if m not in ALL_MODES]
    if unknown or not args.modes:
        ap.error(f"--modes: unknown {unknown}; known {ALL_MODES}")
    if args.storage_gbps is None:
        args.storage_gbps = OFFLINE_GBPS if args.offline else ONLINE_GBPS
    return args


def main_offline(args) -> None:
    """The rollout experiment: the same batch of agents run to completion
    in every mode, modes interleaved round by round."""
    runs = []
    for round_no in range(args.rounds):
        for mode in args.modes:
            row = run_mode(mode, args, None, seed=100 * round_no)
            row = {"round": round_no, "jct_s": row["wall_s"], **row}  # the batch's completion
            runs.append(row)
            print(json.dumps(row), flush=True)
    if args.json:  # first: a table that fails must not lose the runs
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print(offline_table(runs))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.offline:
        return main_offline(args)
    runs = []
    for round_no in range(args.rounds):
        for rate in args.rates:
            for mode in args.modes:
                row = run_mode(mode, args, rate, seed=100 * round_no + int(rate * 10))
                runs.append(row)
                print(json.dumps(row), flush=True)
    print(table(runs, args))
    if args.json:  # first: a plot that fails must not lose the runs
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                               "runs": runs}, indent=1))
    if args.png:
        plot(runs, args, args.png)


if __name__ == "__main__":
    main()
