"""Engine benchmark: DeepServe vs Hugging Face transformers, side by side.

For each batch size it runs the same batch (random prompts of --prompt-len
tokens, --gen-len greedy tokens, EOS ignored) through our engine and through
transformers' generate() on the same weights, and measures in the same run
the machine's memory read/copy bandwidth and bf16 matmul rate, so that the
table shows ratios and how close each phase is to its roofline:

  decode roofline   = (weight bytes + KV bytes read per step) / read bandwidth
  prefill roofline  = prefill FLOPs / matmul rate

    python tools/bench_engine.py --model models/small [--batch-sizes 1,8,32]
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


def measure_machine(dtype: torch.dtype) -> dict:
    """Best of a few runs: read GB/s (sum), copy GB/s (bytes read + written), matmul TFLOP/s."""
    src = torch.ones(256 << 20, dtype=torch.uint8).view(dtype)  # 256 MiB
    dst = torch.empty_like(src)
    read, copy = [], []
    for _ in range(5):
        t = time.perf_counter(); src.sum(); read.append(src.nbytes / (time.perf_counter() - t))
        t = time.perf_counter(); dst.copy_(src); copy.append(2 * src.nbytes / (time.perf_counter() - t))
    a = torch.randn(2048, 896, dtype=dtype)
    b = torch.randn(896, 4864, dtype=dtype)
    flops = []
    for _ in range(5):
        t = time.perf_counter(); a @ b; flops.append(2 * a.shape[0] * 896 * 4864 / (time.perf_counter() - t))
    return {"read_gbps": max(read) / 1e9, "copy_gbps": max(copy) / 1e9,
            "matmul_tflops": max(flops) / 1e12}


def model_numbers(cfg) -> dict:
    """Bytes read by one decode step (weights) and FLOPs per prefill token."""
    e, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    per_layer = e * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * e + 3 * e * i
    linear = layers * per_layer + cfg.vocab_size * e  # lm_head read every step
    size = cfg.dtype.itemsize
    kv_per_token = 2 * layers * cfg.kv_size * size
    return {"weight_bytes": linear * size, "kv_bytes_per_token": kv_per_token,
            "linear_params": layers * per_layer, "layers": layers, "q_size": cfg.q_size}


def prefill_flops(nums: dict, batch: int, prompt_len: int) -> float:
    linear = 2 * nums["linear_params"] * batch * prompt_len
    attention = 2 * 2 * nums["layers"] * nums["q_size"] * batch * prompt_len * prompt_len / 2
    return linear + attention


def run_llm(llm, prompts, gen_len) -> dict:
    """One batch through our LLM API (any mode), timed on the client side."""
    from deepserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    start = time.monotonic()
    first, last, arrivals = {}, {}, []
    for out in llm.stream(prompts, sp):
        now = time.monotonic()
        first.setdefault(out.request_id, now)
        last[out.request_id] = now
        arrivals.append(now)
        assert len(out.token_ids) <= gen_len
    ids = list(first)
    assert len(ids) == len(prompts)
    summary = _summary(start, [first[i] for i in ids], [last[i] for i in ids], gen_len, [])
    # Steady decode: from the moment every request has its first token.
    phase_start, phase_end = max(first.values()), max(last.values())
    num_decode_tokens = sum(1 for t in arrivals if t > phase_start)
    summary["decode_step_s"] = len(prompts) * (phase_end - phase_start) / max(num_decode_tokens, 1)
    summary["decode_window"] = (phase_start, phase_end)
    return summary


def busy_stats(llm, window: tuple[float, float]) -> tuple[float, float]:
    """Inside the window: time the workers spent in forward / wall time, and
    the median idle gap between two forwards (the host-side turnaround)."""
    lo, hi = window
    spans = [(s, e) for s, e in llm.client.stats().forward_spans if e > lo and s < hi]
    busy = sum(min(e, hi) - max(s, lo) for s, e in spans)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    return busy / (hi - lo), statistics.median(gaps) if gaps else 0.0


def run_hf(model, prompts, gen_len) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.monotonic())
            return scores

    ids = torch.tensor(prompts)
    start = time.monotonic()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=gen_len, min_new_tokens=gen_len,
                             logits_processor=LogitsProcessorList([Stamp()]), pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + gen_len and len(stamps) == gen_len
    # Stamp k comes with the logits of token k: the token is known then.
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return _summary(start, [stamps[0]] * len(prompts), [stamps[-1]] * len(prompts),
                    gen_len, steps)


def _summary(start: float, first: list[float], last: list[float], gen_len: int,
             decode_steps: list[float]) -> dict:
    """Medians over requests (TTFT, TPOT) and over pure-decode steps."""
    return {"ttft_s": statistics.median(f - start for f in first),
            "tpot_s": statistics.median((l - f) / (gen_len - 1) for f, l in zip(first, last)),
            "prefill_s": max(first) - start,
            "decode_step_s": statistics.median(decode_steps) if decode_steps else None}


def ensure_model(model: Path, preset: str, dtype: str) -> Path:
    if not (model / "config.json").is_file():
        print(f"generating {preset} model in {model}", file=sys.stderr)
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(model),
                        "--preset", preset, "--dtype", dtype], check=True)
    return model


@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=ROOT / "models" / "small")
@click.option("--preset", default="small", help="make_model preset if --model is absent")
@click.option("--batch-sizes", default="1,8,32")
@click.option("--prompt-len", default=512)
@click.option("--gen-len", default=128)
@click.option("--dtype", default="bfloat16")
@click.option("--max-num-batched-tokens", default=2048)
@click.option("--processes", is_flag=True, help="also run the TE as processes (async scheduling)")
@click.option("--sync", is_flag=True, help="with --processes: also run synchronous scheduling")
@click.option("--tp", default=1, help="tensor-parallel degree of the process-mode TE")
@click.option("--skip-hf", is_flag=True, help="do not run Hugging Face transformers")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(model, preset, batch_sizes, prompt_len, gen_len, dtype, max_num_batched_tokens,
         processes, sync, tp, skip_hf, json_out):
    from deepserve import LLM

    model = ensure_model(model, preset, dtype)
    sizes = [int(b) for b in batch_sizes.split(",")]
    options = dict(dtype=dtype, enable_prefix_caching=False,
                   num_kv_blocks=max(sizes) * (prompt_len + gen_len) // 16 + max(sizes) + 1,
                   max_num_batched_tokens=max_num_batched_tokens)
    modes = {"in-process": {}}
    if processes:
        modes[f"processes tp={tp}"] = dict(processes=True, tp=tp)
        if sync:
            modes[f"processes tp={tp} sync"] = dict(processes=True, tp=tp, async_scheduling=False)
    llms = {name: LLM(str(model), **options, **extra) for name, extra in modes.items()}
    try:
        _bench(llms, model, sizes, prompt_len, gen_len, dtype, skip_hf, json_out)
    finally:
        for llm in llms.values():
            llm.shutdown()


def _bench(llms, model, sizes, prompt_len, gen_len, dtype, skip_hf, json_out) -> None:
    hf = None
    if not skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()
    machine = measure_machine(getattr(torch, dtype))
    any_llm = next(iter(llms.values()))
    cfg = any_llm.engine.model_config if any_llm.engine else _model_config(model, dtype)
    nums = model_numbers(cfg)
    print(f"machine: read {machine['read_gbps']:.1f} GB/s, copy {machine['copy_gbps']:.1f} GB/s, "
          f"bf16 matmul {machine['matmul_tflops']:.2f} TFLOP/s; torch threads "
          f"{torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in sizes:
        prompts = torch.randint(100, cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
        results = {}
        for name, llm in llms.items():
            run_llm(llm, [p[:32] for p in prompts[:1]], 4)  # warm-up
            results[name] = run_llm(llm, prompts, gen_len)
            if llm.client is not None:
                results[name]["busy"], results[name]["gap_s"] = busy_stats(
                    llm, results[name]["decode_window"])
        if hf is not None:
            results["hf"] = run_hf(hf, prompts, gen_len)
        rows.append(_row(batch, prompt_len, gen_len, results, machine, nums))
    _print_table(rows)
    if json_out:
        json_out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


def _model_config(model: Path, dtype: str):
    from deepserve.model.config import load_model_config
    return load_model_config(model, dtype)


def _row(batch, prompt_len, gen_len, results, machine, nums) -> dict:
    avg_ctx = prompt_len + gen_len / 2
    step_bytes = nums["weight_bytes"] + batch * avg_ctx * nums["kv_bytes_per_token"]
    return {"batch": batch, "results": results,
            "decode_roofline_s": step_bytes / (machine["read_gbps"] * 1e9),
            "prefill_roofline_s":
                prefill_flops(nums, batch, prompt_len) / (machine["matmul_tflops"] * 1e12),
            "prompt_tokens": batch * prompt_len}


def _cells(r: dict, m: dict) -> list[str]:
    busy = f"{m['busy']:.3f} / {m['gap_s'] * 1e3:.2f}" if "busy" in m else "-"
    return [f"{r['prompt_tokens'] / m['prefill_s']:.0f}", f"{r['batch'] / m['decode_step_s']:.1f}",
            f"{m['prefill_s']:.2f}", f"{m['ttft_s'] * 1e3:.0f}", f"{m['tpot_s'] * 1e3:.1f}",
            f"{m['decode_step_s'] * 1e3:.1f}", busy,
            f"{m['decode_step_s'] / r['decode_roofline_s']:.2f}",
            f"{m['prefill_s'] / r['prefill_roofline_s']:.2f}"]


def _print_table(rows: list[dict]) -> None:
    print(" | ".join(["batch", "who", "prefill tok/s", "decode tok/s", "batch prefill s",
                      "TTFT p50 ms", "TPOT p50 ms", "decode step ms", "busy / gap ms",
                      "decode step / roofline", "batch prefill / roofline"]))
    for r in rows:
        base = r["results"]["in-process"]
        for who, m in r["results"].items():
            print(" | ".join([str(r["batch"]), who] + _cells(r, m)))
        for who, m in r["results"].items():
            if who != "in-process":
                print(f"{r['batch']} | {who} / in-process | decode tok/s "
                      f"x{base['decode_step_s'] / m['decode_step_s']:.2f} | prefill tok/s "
                      f"x{base['prefill_s'] / m['prefill_s']:.2f}")
    print("roofline: " + ", ".join(
        f"B={r['batch']}: decode step {r['decode_roofline_s'] * 1e3:.1f} ms, "
        f"prefill {r['prefill_roofline_s']:.2f} s" for r in rows))


if __name__ == "__main__":
    main()
