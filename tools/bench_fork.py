"""Fork speed: N nodes pulling one model's files from a peer's weight server at
once (cache/weight_fork.py), as a star and as a chain, beside N nodes copying
it from their own disk.

    python tools/bench_fork.py [--preset small] [--sizes 1,2,4] [--rounds 3] [--json PATH]

One peer: a process serving the model from shared memory (as a node serves
its weight cache) on 127.0.0.1. A measurement starts N processes at once (N
"hosts" on this machine, loopback in between), each forking the whole model
into a directory of its own in /dev/shm, and takes the time until the last
one has it whole:
  star   every process forks from the peer
  chain  process k forks from process k-1 (the first from the peer), each
         relaying its copy under way from a weight server of its own: what
         the cluster manager orders for the nodes of one scale-out
  disk   the same N processes copy the model directory from disk into
         /dev/shm (WeightCache.ensure): a node without a peer (its page cache
         is warm after the first round: a cold disk is slower)
Rounds interleave (star, chain, disk, star, ...) for each N; the table gives
medians with min-max, aggregate GB/s, and N / N=1 (the issue's target: N=4
within 1.5x of N=1). All N copies share this machine's cores and memory
bandwidth, which a cluster's hosts would not. Models: models/<preset> if
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
CHAIN = """
import sys, zmq
from pathlib import Path
from deepserve.cache.weight_fork import Partial, WeightServer, fork_model
dest, partial = Path(sys.argv[3]), Partial()
whole = lambda: {"model": dest} if dest.is_dir() else {}
server = WeightServer(zmq.Context(), sys.argv[2], whole, lambda: {"model": partial})
fork_model(zmq.Context(), [sys.argv[1]], "model", dest, timeout_s=60, partial=partial)
print("done", flush=True)
sys.stdin.read()  # serving the next link until the bench is done
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


def run_chain(source: str, dest: Path, n: int, timeout_s: float) -> float:
    """Seconds until all n links of a chain from `source` have the model whole."""
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", CHAIN, ([source] + addresses)[i],
                               addresses[i], str(dest / str(i))], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "done":
                raise RuntimeError(f"a link failed (exit {p.wait(timeout_s)})")
        return time.perf_counter() - started
    finally:
        for p in procs:
            p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


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
                for method in ("star", "chain", "disk"):
                    dest = work / f"r{r}-{method}-{n}"
                    if method == "star":
                        s = run_n(FORK, lambda i: [address, str(dest / str(i))], n, timeout)
                    elif method == "chain":
                        s = run_chain(address, dest, n, timeout)
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
    print("\n| N | star s (median [min-max]) | chain s | disk s | star GB/s in all | "
          "star N / 1 | chain N / 1 |")
    print("|---|---|---|---|---|---|---|")
    first: dict = {}
    for n in ns:
        st = {m: _stat([x["seconds"] for x in rows if x["method"] == m and x["n"] == n])
              for m in ("star", "chain", "disk")}
        gb = statistics.median(x["gb_s"] for x in rows if x["method"] == "star" and x["n"] == n)
        for m in st:
            first.setdefault(m, st[m]["median"])
        cell = {m: f"{v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" for m, v in st.items()}
        print(f"| {n} | {cell['star']} | {cell['chain']} | {cell['disk']} | {gb:.2f} | "
              f"{st['star']['median'] / first['star']:.2f} | "
              f"{st['chain']['median'] / first['chain']:.2f} |")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
