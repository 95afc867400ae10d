"""Serving side by side: three servers, one client, interleaved rounds.

One script, one model, the same client and workload for every server:
vLLM's own benchmark client (from its venv, tools/vllm_cli.py), random
prompts of --input-len tokens, --output-len tokens with --ignore-eos, at
each --concurrency. The servers, all started at once on consecutive ports:

  * inproc: our in-process engine behind a bare completions server
    (tools/serve_inprocess.py): the engine with no front door;
  * gateway: a one-TE node (bin/deepserve-up with a generated config: no
    prefix caching, the same token budget): gateway, JE, CM, tier service,
    tokenizer, master, worker;
  * vllm: `vllm serve` with the matching options (--vllm-dtype may differ:
    on AVX2-only CPUs vLLM's fast path is float32).

Rounds alternate server by server at every level (inproc, gateway, vllm,
inproc, ...), so the machine's drift hits all alike; the tables give
medians [min-max] and paired per-round ratios (gateway / inproc is the
front door's cost). --py-spy DIR records the gateway node's stacks during
one more c=1 run (py-spy on PATH).

    python tools/bench_serving_vllm.py --vllm-python /work/vllm-venv/bin/python \\
        --model models/small --concurrency 1,8,32 --rounds 2 [--vllm-dtype float32]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_runs  # noqa: E402  (VLLM_ENV)

CONF = """[node]
model = "{model}"
served_model = "{name}"
host = "127.0.0.1"
port = {port}

[[te]]
count = 1
type = "colocated"
dtype = "{dtype}"
enable_prefix_caching = false
max_num_batched_tokens = {budget}
kv_cache_memory = {kv_bytes}
{threads_line}

[supervisor]
# One step of a {budget}-token prefill takes seconds on a small CPU: longer
# than the default deadlines, which would take it for a hung worker.
heartbeat_deadline_s = 300.0
progress_deadline_s = 300.0
"""
METRICS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput")


def wait_ready(url: str, name: str, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            models = httpx.get(f"{url}/v1/models", timeout=5).json()
            if any(m.get("id") == name for m in models.get("data", [])):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready with {name!r} after {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_serve(python: str, url: str, name: str, model: Path, args, concurrency: int,
                out_dir: Path, tag: str) -> dict:
    result = f"{tag}-c{concurrency}.json"
    cmd = [python, str(ROOT / "tools" / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", url, "--model", name, "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args["input_len"]),
           "--random-output-len", str(args["output_len"]), "--ignore-eos",
           "--max-concurrency", str(concurrency),
           "--num-prompts", str(max(args["num_prompts"], concurrency)),
           "--seed", "0", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", result]
    load_before = os.getloadavg()[0]
    subprocess.run(cmd, check=True, cwd="/", env={**os.environ, **bench_runs.VLLM_ENV},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    data = json.loads((out_dir / result).read_text())
    out = {k: data.get(k) for k in METRICS}
    out["load"] = (load_before, os.getloadavg()[0])
    return out


def py_spy(pids: dict[str, int], out_dir: Path, seconds: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(seconds), "-f", "raw",
                              "-o", str(out_dir / f"pyspy-{role}.txt"), "--nonblocking"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for role, pid in pids.items()]


def our_pids(root_pid: int) -> dict[str, int]:
    """Every Python process under the node, named by pid and a word of its title."""
    import psutil

    out = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        words = [w for w in " ".join(child.cmdline()).replace("/", " ").split()
                 if w.isidentifier()] or ["proc"]
        if "python" in " ".join(child.cmdline()):
            out[f"{child.pid}-{words[-1]}"] = child.pid
    return out


SERVERS = ("inproc", "gateway", "vllm")


def start_servers(names: list[str], vllm_python: str, model: Path, name: str, port: int,
                  dtype: str, vllm_dtype: str, budget: int, levels: list[int], input_len: int,
                  output_len: int, threads: int, out_dir: Path) -> dict[str, dict]:
    """Every server at once, each on its own port (port, +1, +2): they idle
    while another is measured (their idle CPU is printed)."""
    from deepserve.model.config import load_model_config

    cfg = load_model_config(model, dtype)
    kv_per_token = 2 * cfg.num_layers * cfg.kv_size * cfg.dtype.itemsize
    kv_bytes = 2 * max(levels) * (input_len + output_len + 32) * kv_per_token
    servers = {}
    for i, who in enumerate(names):
        p = port + i
        log = open(out_dir / f"{who}.log", "w")
        if who == "gateway":
            conf = out_dir / "node.toml"
            conf.write_text(CONF.format(model=model, name=name, port=p, dtype=dtype,
                                        budget=budget, kv_bytes=kv_bytes,
                                        threads_line=f"num_threads = {threads}" if threads
                                        else ""))
            cmd, env, cwd = [str(ROOT / "bin" / "deepserve-up"), "--conf", str(conf)], None, ROOT
        elif who == "inproc":
            cmd = [sys.executable, str(ROOT / "tools" / "serve_inprocess.py"), "--model",
                   str(model), "--served-model", name, "--port", str(p), "--dtype", dtype,
                   "--max-num-batched-tokens", str(budget), "--kv-cache-memory", str(kv_bytes)]
            env, cwd = None, ROOT
        else:
            cmd = [vllm_python, str(ROOT / "tools" / "vllm_cli.py"), "serve", str(model),
                   "--served-model-name", name, "--port", str(p), "--dtype", vllm_dtype,
                   "--max-model-len", str(-(-(input_len + output_len) // 256) * 256),
                   "--max-num-seqs", str(max(levels)),
                   "--max-num-batched-tokens", str(budget), "--no-enable-prefix-caching"]
            env, cwd = {**os.environ, **bench_runs.VLLM_ENV}, "/"
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)
        servers[who] = {"proc": proc, "url": f"http://127.0.0.1:{p}"}
    for who, srv in servers.items():
        srv["start_s"] = wait_ready(srv["url"], name, 1800)
    return servers


def idle_cpu(proc: subprocess.Popen, seconds: float = 3.0) -> float:
    """CPU% (100 = one core) the server's process tree uses while nobody calls it."""
    import psutil

    procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    for p in procs:
        p.cpu_percent(None)
    time.sleep(seconds)
    total = 0.0
    for p in procs:
        try:
            total += p.cpu_percent(None)
        except psutil.NoSuchProcess:
            pass
    return total


def _stats(values: list[float]) -> str:
    import statistics

    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def print_tables(results: dict, names: list[str], levels: list[int]) -> None:
    """Medians [min-max] over rounds per server and level; paired ratios per round."""
    import statistics

    print("\n" + " | ".join(["server", "c", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms",
                              "out tok/s", "max load"]))
    for c in levels:
        for who in names:
            runs = results[(who, c)]
            print(" | ".join([who, str(c), *[_stats([r[m] for r in runs]) for m in METRICS],
                              f"{max(max(r['load']) for r in runs):.2f}"]))
    pairs = [(a, b) for a, b in (("gateway", "inproc"), ("gateway", "vllm"), ("inproc", "vllm"))
             if a in names and b in names]
    print("\n" + " | ".join(["ratio (paired per round)", "c", "TTFT", "TPOT", "ITL",
                              "out tok/s"]))
    for a, b in pairs:
        for c in levels:
            cells = []
            for m in METRICS:
                ratios = [x[m] / y[m] for x, y in zip(results[(a, c)], results[(b, c)])]
                cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-"
                             f"{max(ratios):.2f}]")
            print(" | ".join([f"{a} / {b}", str(c), *cells]))


@click.command()
@click.option("--vllm-python", required=True)
@click.option("--model", type=click.Path(path_type=Path), default=ROOT / "models" / "small")
@click.option("--dtype", default="bfloat16")
@click.option("--vllm-dtype", default=None,
              help="vLLM's dtype (default: --dtype). On CPUs without bf16 arithmetic (AVX2 "
                   "only) vLLM's bf16 runs on torch's fallback matmul: float32 is its fast path")
@click.option("--servers", default=",".join(SERVERS), help="any of inproc, gateway, vllm")
@click.option("--rounds", default=2, help="interleaved rounds: every server at every level")
@click.option("--concurrency", default="1,8,32")
@click.option("--num-prompts", default=4, help="per concurrency level, at least the level")
@click.option("--input-len", default=512)
@click.option("--output-len", default=128)
@click.option("--budget", default=2048, help="max_num_batched_tokens of every server")
@click.option("--port", default=8123, help="the first server's; the others take the next")
@click.option("--py-spy", "spy_dir", type=click.Path(path_type=Path), default=None,
              help="after the rounds, one more c=1 run of the gateway under py-spy")
@click.option("--threads", default=0, help="our worker's torch threads (0: one per core)")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(vllm_python, model, dtype, vllm_dtype, servers, rounds, concurrency, num_prompts,
         input_len, output_len, budget, port, spy_dir, threads, json_out):
    model = model.resolve()
    name = model.name
    names = [s for s in servers.split(",") if s]
    unknown = set(names) - set(SERVERS)
    if unknown:
        raise click.BadParameter(f"unknown server(s) {sorted(unknown)}", param_hint="--servers")
    args = dict(input_len=input_len, output_len=output_len, num_prompts=num_prompts)
    levels = [int(c) for c in concurrency.split(",")]
    out_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    started = start_servers(names, vllm_python, model, name, port, dtype, vllm_dtype or dtype,
                            budget, levels, input_len, output_len, threads, out_dir)
    results: dict = {(who, c): [] for who in names for c in levels}
    try:
        for who, srv in started.items():
            print(f"{who}: ready in {srv['start_s']:.1f} s, idle CPU "
                  f"{idle_cpu(srv['proc']):.0f}%", flush=True)
        for r in range(rounds):
            for c in levels:
                for who in names:
                    res = bench_serve(vllm_python, started[who]["url"], name, model, args, c,
                                      out_dir, f"{who}-r{r}")
                    results[(who, c)].append(res)
                    print(f"round {r + 1} {who} c={c}: " + ", ".join(
                        f"{m} {res[m]:.1f}" for m in METRICS) +
                        f"; load {res['load'][0]:.2f} -> {res['load'][1]:.2f}", flush=True)
        if spy_dir and "gateway" in started:
            spy_dir.mkdir(parents=True, exist_ok=True)
            spies = py_spy(our_pids(started["gateway"]["proc"].pid), spy_dir, 45)
            bench_serve(vllm_python, started["gateway"]["url"], name, model, args, 1, out_dir,
                        "gateway-spy")
            for s in spies:
                s.wait()
    finally:
        for srv in started.values():
            stop(srv["proc"])
    print(f"\nresults in {out_dir}; starts: " + ", ".join(
        f"{who} {srv['start_s']:.1f} s" for who, srv in started.items()))
    print_tables(results, names, levels)
    if json_out:
        json_out.write_text(json.dumps({f"{w} c={c}": v for (w, c), v in results.items()},
                                       indent=1))


if __name__ == "__main__":
    main()
