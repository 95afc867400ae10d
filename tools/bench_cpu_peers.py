"""Our node against llama.cpp's server on the same GGUF file (issue 48).

Servers, all started at once on consecutive ports, each given --threads:

  * ours-MODE for each --ours mode: a one-TE node (bin/deepserve-up with a
    generated config) serving the GGUF file, with `quantize = MODE` ("bf16":
    none, the file dequantized to bf16; "gguf": the file's own Q4_1 / Q8_0
    weights; "int8" / "int4": quantized again from the bf16 import);
  * llama: llama.cpp's OpenAI server (llama-cpp-python[server], from a venv
    of its own built with CMAKE_ARGS="-DGGML_NATIVE=ON"), `--n_threads`;
  * vllm (with --vllm-python): `vllm serve` on the file's bf16 import (our
    importer's directory), bf16, prefix caching off, its OpenMP threads bound
    to the first --threads cores.

The client is ours (tools/bench_serve.py, closed loop, streaming
/v1/completions): llama-cpp-python's server takes text prompts only. Each
request's prompt is a window of tools/data/declaration.txt behind a number
of its own (no server reuses another request's prompt), greedy, --max-tokens
out. llama-cpp-python's server runs one request at a time, so it is measured
at c = 1 only. Rounds alternate server by server at each level (ours-bf16,
ours-gguf, llama, ours-bf16, ...); the table gives medians [min-max] over
rounds of each round's median TTFT and TPOT and its output tokens/s.

    python tools/bench_cpu_peers.py --llama-python /path/llama-venv/bin/python \\
        [--vllm-python /path/vllm-venv/bin/python] [--gguf FILE] [--ours bf16,gguf]
        [--concurrency 1,8] [--rounds 3] [--requests 4]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_quant  # noqa: E402  (cpu)
import bench_runs  # noqa: E402  (VLLM_ENV)
import bench_serve  # noqa: E402
from bench_serving_vllm import idle_cpu, stop  # noqa: E402

NAME = "peer-model"
CONF = """[node]
model = "{model}"
served_model = "{name}"
host = "127.0.0.1"
port = {port}
gguf_cache_dir = "{cache}"

[[te]]
count = 1
type = "colocated"
enable_prefix_caching = false
num_threads = {threads}
{quantize_line}
"""


def wait_ready(url: str, timeout_s: float) -> None:
    """Until GET /v1/models lists NAME (llama-cpp-python's server has no /health)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if any(m.get("id") == NAME for m in httpx.get(f"{url}/v1/models", timeout=5)
                   .json().get("data", [])):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} does not serve {NAME!r} after {timeout_s} s")


def settle(proc: subprocess.Popen, timeout_s: float = 180.0) -> float:
    """Wait until a server's process tree idles (a node warms a pool and its
    weight cache after it answers); its idle CPU % (100 = one core)."""
    deadline = time.monotonic() + timeout_s
    while (cpu := idle_cpu(proc)) > 25 and time.monotonic() < deadline:
        pass
    return cpu


def prompts(count: int, words: int) -> list[str]:
    """count text prompts: windows of the declaration, each behind its own number."""
    text = bench_quant.TEXT.read_text().split()
    step = max(1, (len(text) - words) // max(count, 1))
    return [f"Document {i + 1}. " + " ".join(text[(i * step) % (len(text) - words):][:words])
            for i in range(count)]


def start(who: str, port: int, gguf: Path, threads: int, peers: dict[str, str], out: Path,
          cache: Path, max_seqs: int) -> subprocess.Popen:
    log = open(out / f"{who}.log", "w")
    if who == "vllm":  # the bf16 safetensors our importer made of the same file
        from deepserve.model.gguf import import_gguf

        cmd = [peers["vllm"], str(ROOT / "tools" / "vllm_cli.py"), "serve",
               str(import_gguf(gguf, cache)), "--served-model-name", NAME, "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs",
               str(max_seqs), "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching"]
        env = {**os.environ, **bench_runs.VLLM_ENV,
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        return subprocess.Popen(cmd, cwd="/", env=env, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)
    if who == "llama":
        cmd = [peers["llama"], "-m", "llama_cpp.server", "--model", str(gguf),
               "--model_alias", NAME, "--host", "127.0.0.1", "--port", str(port),
               "--n_threads", str(threads), "--n_threads_batch", str(threads),
               "--n_ctx", "2048"]
    else:
        mode = who.removeprefix("ours-")
        conf = out / f"{who}.toml"
        conf.write_text(CONF.format(model=gguf, name=NAME, port=port, threads=threads,
                                    cache=cache, quantize_line="" if mode == "bf16"
                                    else f'quantize = "{mode}"'))
        cmd = [str(ROOT / "bin" / "deepserve-up"), "--conf", str(conf)]
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT)


def measure(url: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    records = [{"id": f"p{i}", "prompt": t, "max_tokens": max_tokens} for i, t in enumerate(texts)]
    target = bench_serve.Target(url, NAME, None, 600.0, {"temperature": 0.0})
    bench = bench_serve.Bench(target, records, "closed", concurrency=concurrency,
                              num_requests=len(records))
    duration = asyncio.run(bench.run())
    done = [r for r in bench.results if r.ok]
    if len(done) != len(records):
        errors = [r.error for r in bench.results if not r.ok]
        raise RuntimeError(f"{url}: {len(records) - len(done)} requests failed: {errors[:3]}")
    return {"ttft_ms": 1e3 * statistics.median(r.ttft_s for r in done),
            "tpot_ms": 1e3 * statistics.median(r.tpot_s for r in done if r.tpot_s),
            "out_tok_s": sum(r.completion_tokens for r in done) / duration,
            "tokens": statistics.median(r.completion_tokens for r in done)}


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} [{min(values):.1f}-{max(values):.1f}]"


@click.command()
@click.option("--llama-python", required=True, help="python of the llama-cpp-python venv")
@click.option("--vllm-python", default=None, help="python of a vllm-cpu venv: vLLM serves "
              "the file's bf16 import too")
@click.option("--gguf", type=click.Path(path_type=Path), default=None,
              help="default: the built-in SmolLM2-135M-Instruct Q4_1")
@click.option("--ours", default="bf16,gguf", help="our quantize modes (bf16: none)")
@click.option("--concurrency", default="1,8")
@click.option("--rounds", default=3)
@click.option("--requests", default=4, help="per round and level, at least the level")
@click.option("--words", default=200, help="words of text a prompt (~1.4 tokens each)")
@click.option("--max-tokens", default=128)
@click.option("--threads", default=2)
@click.option("--port", default=8300)
def main(llama_python, vllm_python, gguf, ours, concurrency, rounds, requests, words, max_tokens, threads,
         port) -> None:
    from deepserve.model.gguf import builtin_gguf

    gguf = gguf or builtin_gguf()
    levels = [int(c) for c in concurrency.split(",")]
    peers = {"llama": llama_python} | ({"vllm": vllm_python} if vllm_python else {})
    names = [f"ours-{m}" for m in ours.split(",") if m] + list(peers)
    out = Path(tempfile.mkdtemp(prefix="bench-cpu-peers-"))
    procs = {who: start(who, port + i, gguf, threads, peers, out, ROOT / "models" / "gguf",
                        max(levels)) for i, who in enumerate(names)}
    urls = {who: f"http://127.0.0.1:{port + i}" for i, who in enumerate(names)}
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        for who in names:
            wait_ready(urls[who], 900)
        idle = {who: settle(proc) for who, proc in procs.items()}
        number = 0
        for _ in range(rounds):
            for level in levels:
                for who in names:
                    if who == "llama" and level > 1:
                        continue  # one request at a time
                    count = max(requests, level)
                    texts = prompts(number + count, words)[number:]
                    number += count
                    results.setdefault((who, level), []).append(
                        measure(urls[who], texts, level, max_tokens))
    finally:
        for proc in procs.values():
            stop(proc)
    print(f"CPU: {bench_quant.cpu()}; {threads} threads a server; GGUF {gguf.name}; "
          f"logs in {out}")
    print(f"idle CPU % while another is measured: {json.dumps(idle)}")
    print(f"{rounds} rounds interleaved, {requests}+ requests a round, ~{words} words in, "
          f"{max_tokens} tokens out, greedy; medians [min-max] over rounds")
    print(f"{'server':<12} {'c':>3} {'TTFT ms':>22} {'TPOT ms':>22} {'out tok/s':>22} {'tokens':>7}")
    for (who, level), rows in results.items():
        print(f"{who:<12} {level:>3} {_stats([r['ttft_ms'] for r in rows]):>22} "
              f"{_stats([r['tpot_ms'] for r in rows]):>22} "
              f"{_stats([r['out_tok_s'] for r in rows]):>22} "
              f"{statistics.median(r['tokens'] for r in rows):>7.0f}")
    ours_names = [who for who in names if who.startswith("ours-")]
    for who in ours_names:
        if (who, 1) in results:
            print(f"c=1 TPOT llama / {who} per round: "
                  f"{_ratios(results[('llama', 1)], results[(who, 1)], 'tpot_ms')} (> 1: ours faster)")
        for level in levels if "vllm" in peers else ():
            print(f"c={level} out tok/s {who} / vllm per round: "
                  f"{_ratios(results[(who, level)], results[('vllm', level)], 'out_tok_s')}")


def _ratios(top: list[dict], bottom: list[dict], key: str) -> str:
    return _stats([a[key] / b[key] for a, b in zip(top, bottom)]).strip()

if __name__ == "__main__":
    main()
