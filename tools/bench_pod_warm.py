"""How fast a node refills its pre-warmed pool, idle and with the cores busy
(issue 25, item 6: a pod warm in seconds under load).

    python tools/bench_pod_warm.py [--rounds 5] [--busy 0,2] [--json PATH]

One real node ([scaling] pool_size 1, the tiny model, no TE): each
measurement SIGKILLs the ready pre-warmed process by its pid, and the node
replaces it. The figure is the replacement's warm time as the node's health
log shows it: from its `started` event (the supervisor spawned it) to its
`pool_ready` (it said Ready, forkserver up); the pod's own `warm_s` (its
forkserver's start) is shown beside it. While a measurement runs, --busy N
keeps N other processes spinning on the CPU (N = 2 on 2 cores: a loaded
machine); busy levels are interleaved round by round, and the table gives
medians with min-max. Run it with PYTHONPATH pointing at another tree's
src to time that tree's pods the same way (the node runs in this process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import click
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # bench_scaling.py, bench_stats.py
import bench_scaling  # noqa: E402
import bench_stats  # noqa: E402

SPIN = "import os\nwhile os.getppid() != 1: pass"  # ends when this process is gone


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def ready_pod(s: bench_scaling.Subject) -> str | None:
    return next((name for name, ready in dict(s.node.scaler.pods).items() if ready), None)


def measure(s: bench_scaling.Subject, timeout_s: float) -> dict:
    """Kill the ready pod; the replacement's started -> pool_ready."""
    victim = bench_scaling.wait_until(lambda: ready_pod(s), timeout_s, "a ready pod", [s])
    pid = s.node.table.pid(victim)
    since = s.mark()
    os.kill(pid, signal.SIGKILL)

    def replaced():
        ready = [e for e in s.events(since, "pool_ready") if e["component"] != victim]
        return ready[0] if ready else None
    ready = bench_scaling.wait_until(replaced, timeout_s, "the replacement pod", [s])
    started = next(e for e in s.events(since, "started") if e["component"] == ready["component"])
    return {"pod": ready["component"], "spawn_to_ready_s":
            round(_seconds(ready["time"]) - _seconds(started["time"]), 3),
            "forkserver_s": ready["details"].get("warm_s")}


def spin(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def reap(spinners: list[subprocess.Popen]) -> None:
    for p in spinners:
        p.kill()
    for p in spinners:
        p.wait(10)


def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return (f"{bench_stats.percentile(values, 50):.2f} "
            f"[{min(values):.2f}-{max(values):.2f}]")


def table(rows: list[dict], levels: list[int]) -> str:
    lines = ["| busy processes | spawn -> pool_ready (s) | its forkserver start (s) | n |",
             "|---|---|---|---|"]
    for n in levels:
        mine = [r for r in rows if r["busy"] == n]
        forkserver = [r["forkserver_s"] for r in mine if r["forkserver_s"] is not None]
        lines.append(f"| {n} | {fmt([r['spawn_to_ready_s'] for r in mine])} | {fmt(forkserver)} "
                     f"| {len(mine)} |")
    return "\n".join(lines)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--rounds", default=5, help="measurements per busy level, interleaved")
@click.option("--busy", default="0,2", help="spinning processes during a measurement, per level")
@click.option("--model", default=str(ROOT / "models" / "tiny"), help="the node's model (its "
              "pods load none)")
@click.option("--timeout", default=120.0, help="seconds for one replacement")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(rounds, busy, model, timeout, json_path):
    levels = [int(x) for x in busy.split(",")]
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; deepserve from "
          f"{Path(sys.modules['deepserve'].__file__).parents[1]}", flush=True)
    rows: list[dict] = []
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="bench_pod_warm-") as logs:
        # every kill is a pod death: a budget above them, or the pool gives up
        # (pool_backoff.py); the backoff delays a spawn, never spawn -> ready
        s = bench_scaling.Subject("prewarmed", Path(model), Path(logs), 1, 0, timeout,
                                  max_restarts=10 * rounds * len(levels))
        try:
            s.start(ctx)
            for r in range(rounds):
                for n in levels:
                    spinners = spin(n)
                    try:
                        time.sleep(1.0 if n else 0.0)  # the spinners at full speed first
                        row = {"round": r, "busy": n, **measure(s, timeout)}
                    finally:
                        reap(spinners)
                    rows.append(row)
                    print(f"  round {r} busy {n}: {row['spawn_to_ready_s']:.2f} s "
                          f"(forkserver {row['forkserver_s']})", flush=True)
        finally:
            s.stop()
            ctx.term()
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    print("\n" + table(rows, levels))


if __name__ == "__main__":
    main()
