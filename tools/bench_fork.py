"""Fork speed: N nodes pulling one model's files from a peer's weight server at
once (cache/weight_fork.py), beside N nodes copying it from their own disk.

    python tools/bench_fork.py [--preset small] [--sizes 1,2,4] [--rounds 3] [--json PATH]

One peer: a process serving the model from shared memory (as a node serves
its weight cache) on 127.0.0.1. A measurement starts N processes at once (N
"hosts" on this machine, loopback in between), each forking the whole model
into a directory of its own in /dev/shm, and takes the time until the last
one has it whole. The baseline ("disk") is the same N processes copying the
model directory from disk into /dev/shm (WeightCache.ensure): what a node
without a peer does (its page cache is warm after the first round: a cold
disk is slower). Rounds interleave (fork, disk, fork, disk ...) for each N;
the table gives medians with min-max, aggregate GB/s, and fork N / fork 1
(the issue's target: N=4 within 1.5x of N=1; without a relay chain every
host pulls from the one peer, which bounds it). Models: models/<preset> if
present, else tools/make_model.py --preset <preset> into a temporary directory.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from deepserve.ipc.sockets import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from bench_scaling import model_dir_for  # noqa: E402  models/<preset>, or generated
SHM = Path("/dev/shm")
SERVE = """
import sys, time, zmq
from pathlib import Path
from deepserve.cache.weight_fork import WeightServer
WeightServer(zmq.Context(), sys.argv[1], lambda: {"model": Path(sys.argv[2])})
print("up", flush=True)
sys.stdin.read()
"""
FORK = """
import sys, zmq
from pathlib import Path
from deepserve.cache.weight_fork import fork_model
fork_model(zmq.Context(), [sys.argv[1]], "model", Path(sys.argv[2]), timeout_s=60)
"""
DISK = """
import sys
from deepserve.cache.weight_cache import WeightCache
WeightCache(sys.argv[2], 1 << 40).ensure(sys.argv[1])
"""


def run_n(script: str, args_of, n: int, timeout_s: float) -> float:
    """Seconds until all n processes (script, args_of(i)) finished, each exit 0."""
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", script, *args_of(i)], cwd=ROOT)
             for i in range(n)]
    try:
        for p in procs:
            if p.wait(timeout_s) != 0:
                raise RuntimeError(f"a copy failed (exit {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return time.perf_counter() - started


def _stat(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@click.command()
@click.option("--preset", default="small", help="model preset (tools/make_model.py)")
@click.option("--sizes", default="1,2,4", help="nodes copying at once")
@click.option("--rounds", default=3, help="interleaved rounds per method and size")
@click.option("--timeout", default=600.0, help="seconds for one measurement")
@click.option("--json", "json_path", default=None, help="write the rows here")
def main(preset: str, sizes: str, rounds: int, timeout: float, json_path: str | None) -> None:
    ns = [int(s) for s in sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-fork-"))
    work = Path(tempfile.mkdtemp(prefix="deepserve-bench-fork-", dir=SHM))
    server = None
    rows = []
    try:
        model = model_dir_for(preset, tmp)
        nbytes = sum(f.stat().st_size for f in model.iterdir() if f.is_file())
        held = work / "peer"
        shutil.copytree(model, held)  # the peer's weight cache: the model in memory
        address = f"tcp://127.0.0.1:{free_port()}"
        server = subprocess.Popen([sys.executable, "-c", SERVE, address, str(held)], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        print(f"# {preset}: {nbytes / 1e9:.2f} GB, sizes {ns}, {rounds} rounds", flush=True)
        for r in range(rounds):
            for n in ns:
                for method in ("fork", "disk"):
                    dest = work / f"r{r}-{method}-{n}"
                    if method == "fork":
                        s = run_n(FORK, lambda i: [address, str(dest / str(i))], n, timeout)
                    else:
                        s = run_n(DISK, lambda i: [str(model), str(dest / str(i))], n, timeout)
                    shutil.rmtree(dest, ignore_errors=True)
                    rows.append({"preset": preset, "method": method, "n": n, "round": r,
                                 "seconds": s, "gb_s": n * nbytes / s / 1e9})
                    print(f"round {r} {method:<4} N={n}: {s:.2f} s "
                          f"({n * nbytes / s / 1e9:.2f} GB/s in all)", flush=True)
    finally:
        if server is not None:
            server.stdin.close()
            server.kill()
            server.wait(10)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n| N | fork s (median [min-max]) | disk s | fork GB/s in all | fork N / fork 1 |")
    print("|---|---|---|---|---|")
    one = None
    for n in ns:
        f = _stat([x["seconds"] for x in rows if x["method"] == "fork" and x["n"] == n])
        d = _stat([x["seconds"] for x in rows if x["method"] == "disk" and x["n"] == n])
        gb = statistics.median(x["gb_s"] for x in rows if x["method"] == "fork" and x["n"] == n)
        one = one or f["median"]
        print(f"| {n} | {f['median']:.2f} [{f['min']:.2f}-{f['max']:.2f}] | "
              f"{d['median']:.2f} [{d['min']:.2f}-{d['max']:.2f}] | {gb:.2f} | "
              f"{f['median'] / one:.2f} |")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
