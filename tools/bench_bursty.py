"""Bursty two-model benchmark: an autoscaled node (each model scaled on
demand, to zero when idle) against static provisioning (k TEs per model the
whole time) on the same seeded trace, at TE-seconds as equal as integer k allows.

    python tools/bench_bursty.py [--model-a DIR --model-b DIR] [--duration-scale 1.0]
        [--base-rps 0.2] [--burst 10] [--slo-ttft-ms 2000] [--slo-tpot-ms 250]
        [--repeat 1] [--static-tes K] [--png bursty.png] [--json bursty.json]

The trace, per model (seconds at --duration-scale 1; rate in units of --base-rps):

    a  idle 10 | base 30 | burst 20 (x10) | base 20 | idle 70     (150 s)
    b  idle 50 | base 30 | burst 20 (x10) | base 20 | idle 30     (bursts do not overlap)

Arrivals are seeded Poisson; each request is a streamed /v1/completions of
20-60 prompt words and max_tokens 16-32. The runs go one after the other
(auto, static, auto, static ...: never two nodes at once); static's k is
max(1, round(TE-seconds of the first auto run / (duration * 2 models))).

Per run: SLO attainment (a request meets the SLO when it succeeded with TTFT
<= --slo-ttft-ms and TPOT <= --slo-tpot-ms; TPOT = (last token - first token)
/ (tokens - 1)), TE-seconds (the gateway's deepserve_model_tes gauge, polled
every 0.5 s, integrated over the trace: TEs listed, not those still starting;
pre-warmed pool processes are not TEs), scale-outs during the trace from the
health log (by source: cold, prewarmed, prewarmed_cache), p50/p99 TTFT, and
failed requests. With --repeat, each kind's row is the median over repeats.
The PNG (first repeat) has one row per run kind and one column per model:
offered load (arrivals per second, binned) and TEs over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deepserve.config.models import ModelSpec, ScalingSection, SLOSection
from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, SupervisorConfig

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("a", "b")
PHASES = {"a": [(10, 0), (30, 1), (20, "burst"), (20, 1), (70, 0)],
          "b": [(50, 0), (30, 1), (20, "burst"), (20, 1), (30, 0)]}
"""Per model: (seconds at --duration-scale 1, rate in base units or the burst)."""
WORDS = ("system cache memory request latency model token layer batch queue thread process "
         "network storage engine kernel device buffer stream vector matrix graph tree index "
         "schedule route balance prefix block policy budget profile trace sample metric").split()
POLL_S = 0.5
BIN_S = 5.0  # the plot's load bins (seconds at scale 1)


sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is no package
import bench_client as client  # noqa: E402  one streamed request, timed (TTFT, gaps, usage)
from bench_stats import percentile  # noqa: E402


# -- the trace ----------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    t: float  # seconds since the trace started
    model: str
    prompt: str
    max_tokens: int


def rate_steps(model: str, args) -> list[tuple[float, float, float]]:
    """(start s, end s, requests per second) of each phase of model."""
    steps, t = [], 0.0
    for seconds, units in PHASES[model]:
        rps = args.base_rps * (args.burst if units == "burst" else units)
        steps.append((t, t + seconds * args.duration_scale, rps))
        t += seconds * args.duration_scale
    return steps


def make_trace(args) -> list[Arrival]:
    """Seeded Poisson arrivals of both models, in time order (the same every run)."""
    out = []
    for i, model in enumerate(MODELS):
        rng = random.Random(args.seed * 1000 + i)
        for start, end, rps in rate_steps(model, args):
            t = start
            while rps > 0:
                t += rng.expovariate(rps)
                if t >= end:
                    break
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
                out.append(Arrival(round(t, 3), model, prompt, rng.randint(16, 32)))
    return sorted(out, key=lambda a: a.t)


def trace_duration(args) -> float:
    return max(rate_steps(m, args)[-1][1] for m in MODELS)


# -- one run ------------------------------------------------------------------------
@dataclass
class Run:
    kind: str  # "auto" or "static"
    tes_per_model: int | None  # static: k
    t0_wall: float = 0.0
    results: list = field(default_factory=list)  # (Arrival, RequestResult)
    samples: list = field(default_factory=list)  # (t, {model: TEs})
    scale_outs: list = field(default_factory=list)  # health-log scaled_out events
    decisions: list = field(default_factory=list)  # the autoscaler's scale-out decisions


def model_specs(args, paths: dict[str, str], k: int | None) -> list[ModelSpec]:
    options = {"max_num_batched_tokens": 256, "kv_cache_memory": 64 << 20,
               "num_threads": args.threads}
    slo = SLOSection(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    if k is None:
        return [ModelSpec(name=m, path=paths[m], min_tes=0, max_tes=args.max_tes,
                          idle_s=args.idle_s, options=options, slo=slo) for m in MODELS]
    return [ModelSpec(name=m, path=paths[m], min_tes=k, max_tes=k, options=options, slo=slo)
            for m in MODELS]


def model_tes(url: str, http: httpx.Client) -> dict[str, int] | None:
    """deepserve_model_tes per model from the gateway's /metrics (None: no answer)."""
    try:
        text = http.get(url + "/metrics").text
    except httpx.HTTPError:
        return None
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "deepserve_model_tes":
            out.update({s.labels["model"]: int(s.value) for s in family.samples})
    return out


def poll(url: str, run: Run, t0: float, stop: threading.Event) -> None:
    with httpx.Client(timeout=5.0) as http:
        while not stop.is_set():
            tes = model_tes(url, http)
            if tes is not None:
                run.samples.append((time.monotonic() - t0, tes))
            stop.wait(POLL_S)


def wait_ready(node: Node, want: int, pool_size: int, timeout_s: float) -> None:
    """Until every model lists `want` TEs (static: its k) and the pre-warmed
    pool is warm: the trace starts on a node in its steady state, in both runs."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as http:
        while time.monotonic() < deadline:
            tes = model_tes(node.url, http) or {}
            warm = len(health_events(node.log_dir, "pool_ready"))
            if all(tes.get(m, 0) == want for m in MODELS) and warm >= pool_size:
                return
            time.sleep(0.5)
    raise TimeoutError(f"not {want} TEs per model and a warm pool after {timeout_s} s")


async def drive(url: str, trace: list[Arrival], run: Run, t0: float, timeout_s: float) -> None:
    """Open loop: each arrival at its time, whatever is still running."""
    targets = {m: client.Target(url=url, model=m, timeout_s=timeout_s,
                                extra={"temperature": 0.0}) for m in MODELS}
    tasks = []
    async with client.make_client(targets["a"]) as http:
        for arrival in trace:
            await asyncio.sleep(max(0.0, t0 + arrival.t - time.monotonic()))
            result = client.RequestResult(session=arrival.model, turn=len(tasks),
                                          start_s=arrival.t)
            turn = {"prompt": arrival.prompt, "max_tokens": arrival.max_tokens}
            run.results.append((arrival, result))
            tasks.append(asyncio.create_task(
                client.send(targets[arrival.model], turn, [], result, http)))
        await asyncio.gather(*tasks)


def health_events(log_dir: Path, event: str) -> list[dict]:
    lines = (log_dir / "health.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == event]


def wall_time(event: dict) -> float:
    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


def during(log_dir: Path, event: str, t0_wall: float, t1_wall: float) -> list[dict]:
    return [e for e in health_events(log_dir, event) if t0_wall <= wall_time(e) <= t1_wall]


def run_once(kind: str, k: int | None, args, paths, trace, log_root: Path) -> Run:
    run = Run(kind, k)
    log_dir = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=log_root))
    config = NodeConfig.build(
        port=free_port(), startup_timeout_s=300, te_timeout_s=10,
        supervisor=SupervisorConfig(log_dir=str(log_dir), startup_grace_s=300),
        models=model_specs(args, paths, k),
        scaling=ScalingSection(pool_size=args.pool_size, queue_timeout_s=args.request_timeout_s,
                               out_cooldown_s=2.0,
                               in_cooldown_s=5.0, in_sustain_s=5.0))
    node, stop = Node(config), threading.Event()
    try:
        node.start()
        wait_ready(node, k or 0, args.pool_size, 300)
        t0, run.t0_wall = time.monotonic(), time.time()
        poller = threading.Thread(target=poll, args=(node.url, run, t0, stop), daemon=True)
        poller.start()
        asyncio.run(drive(node.url, trace, run, t0, args.request_timeout_s))
        time.sleep(max(0.0, t0 + trace_duration(args) - time.monotonic()))
        stop.set()
        poller.join()
        now = time.time()
        run.scale_outs = during(log_dir, "scaled_out", run.t0_wall, now)
        run.decisions = [e["details"]["reason"] for e in
                         during(log_dir, "scale_decision", run.t0_wall, now)
                         if e["details"]["direction"] == "out"]
    finally:
        stop.set()
        procs = list(node.procs.values())
        node.stop()
        check_clean(node.run_id, procs)
    return run


def check_clean(run_id: str, procs: list) -> None:
    """Warn about what a stopped node left: live children or shared memory."""
    alive = [p.pid for p in procs if p.poll() is None]
    left = sorted(p.name for p in Path("/dev/shm").glob(f"deepserve-*{run_id}*"))
    if alive or left:
        print(f"warning: node {run_id} left processes {alive} and shared memory {left}",
              file=sys.stderr)


# -- numbers ------------------------------------------------------------------------
def te_seconds(run: Run, duration: float) -> dict[str, float]:
    """Per model: the TE gauge integrated (step, left value) over [0, duration]."""
    out = {m: 0.0 for m in MODELS}
    points = [(0.0, run.samples[0][1] if run.samples else {})] + run.samples
    for (t, tes), (t_next, _) in zip(points, points[1:] + [(duration, None)]):
        span = max(0.0, min(t_next, duration) - min(t, duration))
        for m in MODELS:
            out[m] += tes.get(m, 0) * span
    return out


def meets_slo(result, args) -> bool:
    if not result.ok or result.ttft_s is None:
        return False
    tpot_ok = (result.completion_tokens < 2 or
               sum(result.itl_s) / (result.completion_tokens - 1) * 1000 <= args.slo_tpot_ms)
    return result.ttft_s * 1000 <= args.slo_ttft_ms and tpot_ok


def summary(run: Run, args, duration: float) -> dict:
    results = [r for _, r in run.results]
    ttft = [r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None]
    tes = te_seconds(run, duration)
    sources: dict[str, int] = {}
    for e in run.scale_outs:
        source = e["details"].get("source", "?")
        sources[source] = sources.get(source, 0) + 1
    errors = sorted({(r.error or "")[:160] for r in results if not r.ok})
    return {"kind": run.kind, "tes_per_model": run.tes_per_model, "num_requests": len(results),
            "slo_attainment": sum(meets_slo(r, args) for r in results) / max(1, len(results)),
            "te_seconds": sum(tes.values()), "te_seconds_per_model": tes,
            "scale_outs": len(run.scale_outs), "scale_out_sources": sources,
            "scale_out_decisions": run.decisions,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "num_failed": sum(not r.ok for r in results), "errors": errors[:5]}


def median_row(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for key in ("slo_attainment", "te_seconds", "scale_outs", "ttft_p50_ms", "ttft_p99_ms",
                "num_failed"):
        values = [r[key] for r in rows if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["repeats"] = len(rows)
    return out


HEADER = "run        | SLO att. | TE-seconds | scale-outs | TTFT p50 ms | TTFT p99 ms | failed"


def line(row: dict) -> str:
    name = row["kind"] if row["kind"] == "auto" else f"static k={row['tes_per_model']}"
    ms = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    return (f"{name:<10} | {row['slo_attainment']:8.3f} | {row['te_seconds']:10.1f} | "
            f"{row['scale_outs']:10g} | {ms(row['ttft_p50_ms']):>11} | "
            f"{ms(row['ttft_p99_ms']):>11} | {row['num_failed']:g}")


# -- the picture --------------------------------------------------------------------
def plot(runs: list[Run], args, duration: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), len(MODELS), figsize=(12, 3.2 * len(runs)),
                             sharex=True, squeeze=False)
    bin_s = BIN_S * args.duration_scale
    num_bins = int(duration / bin_s + 0.999)
    for row, run in enumerate(runs):
        label = "autoscaled" if run.kind == "auto" else f"static k={run.tes_per_model}"
        for col, model in enumerate(MODELS):
            ax = axes[row][col]
            counts = [0] * num_bins
            for arrival, _ in run.results:
                if arrival.model == model:
                    counts[min(num_bins - 1, int(arrival.t / bin_s))] += 1
            ax.bar([i * bin_s for i in range(num_bins)], [c / bin_s for c in counts],
                   width=bin_s, align="edge", color="tab:blue", alpha=0.35,
                   label="arrivals/s (binned)")
            steps = rate_steps(model, args)
            ax.step([s[0] for s in steps] + [steps[-1][1]], [s[2] for s in steps] +
                    [steps[-1][2]], where="post", color="tab:blue", lw=1, ls="--",
                    label="offered rate")
            ax.set_ylabel("requests/s", color="tab:blue")
            twin = ax.twinx()
            twin.step([t for t, _ in run.samples], [s.get(model, 0) for _, s in run.samples],
                      where="post", color="tab:red", lw=1.8, label="TEs")
            twin.set_ylim(0, max(args.max_tes, run.tes_per_model or 0) + 0.5)
            twin.set_ylabel("TEs", color="tab:red")
            ax.set_title(f"{label}: model {model}")
            ax.set_xlim(0, duration)
            if row == len(runs) - 1:
                ax.set_xlabel("seconds since trace start")
            if row == 0 and col == 0:
                handles = ax.get_legend_handles_labels()
                more = twin.get_legend_handles_labels()
                ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right",
                          fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------
def model_dirs(args, root: Path) -> dict[str, str]:
    """--model-a/--model-b, or two tiny models made here (different seeds and archs)."""
    paths = {"a": args.model_a, "b": args.model_b}
    for model, seed, arch in (("a", 1, "qwen2"), ("b", 2, "llama")):
        if paths[model] is None:
            out = root / f"model-{model}"
            subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(out),
                            "--preset", "tiny", "--seed", str(seed), "--arch", arch],
                           check=True, stdout=subprocess.DEVNULL)
            paths[model] = str(out)
    return paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-a", default=None, help="model dir (default: a tiny one, made here)")
    p.add_argument("--model-b", default=None, help="model dir (default: a tiny one, made here)")
    p.add_argument("--duration-scale", type=float, default=1.0, help="multiplies every phase")
    p.add_argument("--base-rps", type=float, default=0.2, help="base rate per model, req/s")
    p.add_argument("--burst", type=float, default=10.0, help="burst rate / base rate")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=250.0)
    p.add_argument("--max-tes", type=int, default=2, help="autoscaled: TEs per model at most")
    p.add_argument("--idle-s", type=float, default=10.0, help="autoscaled: to zero after this")
    p.add_argument("--pool-size", type=int, default=2, help="pre-warmed TE processes")
    p.add_argument("--static-tes", type=int, default=None, help="static k (default: matched)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per TE")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--repeat", type=int, default=1, help="auto/static pairs, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default="bursty.png")
    p.add_argument("--json", default=None)
    p.add_argument("--keep-logs", action="store_true", help="keep the nodes' health logs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-bursty-"))
    try:
        paths = model_dirs(args, root)
        trace, duration = make_trace(args), trace_duration(args)
        print(f"trace: {len(trace)} requests over {duration:.0f} s "
              f"({', '.join(f'{m}: {sum(a.model == m for a in trace)}' for m in MODELS)})",
              flush=True)
        runs: list[Run] = []
        k = args.static_tes
        for i in range(args.repeat):
            for kind in ("auto", "static"):
                run = run_once(kind, None if kind == "auto" else k, args, paths, trace, root)
                runs.append(run)
                row = summary(run, args, duration)
                print(f"[{i + 1}/{args.repeat}] {line(row)}", flush=True)
                if kind == "auto" and k is None:
                    k = max(1, round(row["te_seconds"] / (duration * len(MODELS))))
        rows = [summary(r, args, duration) for r in runs]
        table = [median_row([r for r in rows if r["kind"] == kind]) for kind in ("auto", "static")]
        print(f"\nSLO: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms; "
              f"medians over {args.repeat} repeat(s); TE-seconds over {duration:.0f} s "
              f"x {len(MODELS)} models (static k = {k}: "
              f"auto {table[0]['te_seconds']:.1f} vs static {table[1]['te_seconds']:.1f})")
        print(HEADER)
        for row in table:
            print(line(row))
        for row in rows:
            reasons = {r: row["scale_out_decisions"].count(r) for r in row["scale_out_decisions"]}
            print(f"{row['kind']}: scale-outs by source {row['scale_out_sources']}, "
                  f"decided by reason {reasons}")
            if row["errors"]:
                print(f"errors ({row['kind']}): {row['errors']}")
        plot(runs[:2], args, duration, args.png)
        print(f"timeline: {args.png}")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"args": vars(args), "duration_s": duration, "num_requests": len(trace),
                 "table": table, "runs": rows,
                 "timelines": [{"kind": r.kind, "samples": r.samples} for r in runs]},
                indent=1))
        return 1 if any(r["num_failed"] for r in rows) else 0
    finally:
        if args.keep_logs:
            print(f"logs and models kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
