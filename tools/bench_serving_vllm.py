"""Serving side by side: `vllm bench serve` against our gateway and `vllm serve`.

One script, one model, the same client and workload for both servers:
vLLM's own benchmark client (from its venv, tools/vllm_cli.py), random
prompts of --input-len tokens, --output-len tokens with --ignore-eos, at
each --concurrency. Ours is a one-TE node (bin/deepserve-up with a
generated config: bf16, no prefix caching, the same token budget as vLLM);
theirs is `vllm serve` with the matching options. Prints one table of TTFT,
TPOT and ITL medians and output throughput; --py-spy DIR also records our
gateway's, master's and worker's stacks during concurrency 1 (py-spy on PATH).

    python tools/bench_serving_vllm.py --vllm-python /work/vllm-venv/bin/python \\
        --model models/small [--concurrency 1,8] [--num-prompts 8]
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


@click.command()
@click.option("--vllm-python", required=True)
@click.option("--model", type=click.Path(path_type=Path), default=ROOT / "models" / "small")
@click.option("--dtype", default="bfloat16")
@click.option("--concurrency", default="1,8")
@click.option("--num-prompts", default=4, help="per concurrency level, at least the level")
@click.option("--input-len", default=512)
@click.option("--output-len", default=128)
@click.option("--budget", default=2048, help="max_num_batched_tokens of both servers")
@click.option("--port", default=8123)
@click.option("--py-spy", "spy_dir", type=click.Path(path_type=Path), default=None)
@click.option("--skip-vllm-server", is_flag=True, help="only our gateway")
@click.option("--threads", default=0, help="our worker's torch threads (0: one per core)")
def main(vllm_python, model, dtype, concurrency, num_prompts, input_len, output_len, budget,
         port, spy_dir, skip_vllm_server, threads):
    model = model.resolve()
    name = model.name
    url = f"http://127.0.0.1:{port}"
    args = dict(input_len=input_len, output_len=output_len, num_prompts=num_prompts)
    levels = [int(c) for c in concurrency.split(",")]
    out_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    rows = {}
    conf = out_dir / "node.toml"
    from deepserve.model.config import load_model_config
    cfg = load_model_config(model, dtype)
    kv_per_token = 2 * cfg.num_layers * cfg.kv_size * cfg.dtype.itemsize
    conf.write_text(CONF.format(model=model, name=name, port=port, dtype=dtype, budget=budget,
                                threads_line=f"num_threads = {threads}" if threads else "",
                                kv_bytes=2 * max(levels) * (input_len + output_len + 32) *
                                kv_per_token))
    ours = subprocess.Popen([str(ROOT / "bin" / "deepserve-up"), "--conf", str(conf)],
                            cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(out_dir / "ours.log", "w"))
    try:
        rows["ours start s"] = wait_ready(url, name, 600)
        for c in levels:
            rows[f"ours c={c}"] = bench_serve(vllm_python, url, name, model, args, c, out_dir,
                                              "ours")
            print(f"ours c={c}: {rows[f'ours c={c}']}", flush=True)
        if spy_dir:  # one more c=1 run under py-spy, not in the table's measured rows
            spy_dir.mkdir(parents=True, exist_ok=True)
            spies = py_spy(our_pids(ours.pid), spy_dir, 45)
            rows["ours c=1 under py-spy"] = bench_serve(vllm_python, url, name, model, args, 1,
                                                        out_dir, "ours-spy")
            for s in spies:
                s.wait()
    finally:
        stop(ours)
    if not skip_vllm_server:
        theirs = subprocess.Popen(
            [vllm_python, str(ROOT / "tools" / "vllm_cli.py"), "serve", str(model),
             "--served-model-name", name, "--port", str(port), "--dtype", dtype,
             "--max-model-len", str(-(-(input_len + output_len) // 256) * 256),
             "--max-num-seqs", str(max(levels)),
             "--max-num-batched-tokens", str(budget), "--no-enable-prefix-caching"],
            cwd="/", start_new_session=True, env={**os.environ, **bench_runs.VLLM_ENV},
            stdout=open(out_dir / "vllm.log", "w"), stderr=subprocess.STDOUT)
        try:
            rows["vllm start s"] = wait_ready(url, name, 1800)
            for c in levels:
                rows[f"vllm c={c}"] = bench_serve(vllm_python, url, name, model, args, c,
                                                  out_dir, "vllm")
                print(f"vllm c={c}: {rows[f'vllm c={c}']}", flush=True)
        finally:
            stop(theirs)
    print(f"\nresults in {out_dir}")
    print(" | ".join(["server", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms", "out tok/s", "load"]))
    for key, r in rows.items():
        if isinstance(r, dict):
            print(" | ".join([key] + [f"{r[m]:.1f}" for m in METRICS] +
                             [f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}"]))
        else:
            print(f"{key}: {r:.1f}")


if __name__ == "__main__":
    main()
