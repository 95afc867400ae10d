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


def run_ours(llm, prompts, gen_len) -> dict:
    from deepserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    engine = llm.engine
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p in prompts]
    first, last, decode_steps = {}, {}, []
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        if len(outs) == len(prompts) and all(len(o.token_ids) > 1 for o in outs):
            decode_steps.append(now - step_start)  # every sequence decoding, no prefill
        for out in outs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            assert len(out.token_ids) <= gen_len
    return _summary(start, [first[i] for i in ids], [last[i] for i in ids], gen_len,
                    decode_steps)


def run_hf(model, prompts, gen_len) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts)
    start = time.perf_counter()
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
            "decode_step_s": statistics.median(decode_steps)}


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
@click.option("--skip-hf", is_flag=True, help="measure only DeepServe")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(model, preset, batch_sizes, prompt_len, gen_len, dtype, max_num_batched_tokens,
         skip_hf, json_out):
    from deepserve import LLM

    model = ensure_model(model, preset, dtype)
    sizes = [int(b) for b in batch_sizes.split(",")]
    kv_tokens = max(sizes) * (prompt_len + gen_len)
    llm = LLM(str(model), dtype=dtype, enable_prefix_caching=False,
              num_kv_blocks=kv_tokens // 16 + max(sizes) + 1,
              max_num_batched_tokens=max_num_batched_tokens)
    hf = None
    if not skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()
    machine = measure_machine(getattr(torch, dtype))
    nums = model_numbers(llm.engine.model_config)
    print(f"machine: read {machine['read_gbps']:.1f} GB/s, copy {machine['copy_gbps']:.1f} GB/s, "
          f"bf16 matmul {machine['matmul_tflops']:.2f} TFLOP/s; torch threads "
          f"{torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    rows = []
    for batch in sizes:
        prompts = torch.randint(100, vocab, (batch, prompt_len), generator=gen).tolist()
        run_ours(llm, [p[:32] for p in prompts[:1]], 4)  # warm-up
        ours = run_ours(llm, prompts, gen_len)
        theirs = run_hf(hf, prompts, gen_len) if hf is not None else None
        rows.append(_row(batch, prompt_len, gen_len, ours, theirs, machine, nums))
    _print_table(rows)
    if json_out:
        json_out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


def _row(batch, prompt_len, gen_len, ours, theirs, machine, nums) -> dict:
    avg_ctx = prompt_len + gen_len / 2
    step_bytes = nums["weight_bytes"] + batch * avg_ctx * nums["kv_bytes_per_token"]
    return {"batch": batch, "ours": ours, "hf": theirs,
            "decode_roofline_s": step_bytes / (machine["read_gbps"] * 1e9),
            "prefill_roofline_s":
                prefill_flops(nums, batch, prompt_len) / (machine["matmul_tflops"] * 1e12),
            "prompt_tokens": batch * prompt_len}


def _phase_cells(r: dict, m: dict) -> list[str]:
    return [f"{r['prompt_tokens'] / m['prefill_s']:.0f}", f"{r['batch'] / m['decode_step_s']:.1f}",
            f"{m['prefill_s']:.2f}", f"{m['ttft_s'] * 1e3:.0f}", f"{m['tpot_s'] * 1e3:.1f}",
            f"{m['decode_step_s'] * 1e3:.1f}"]


def _print_table(rows: list[dict]) -> None:
    phase = ("prefill tok/s", "decode tok/s", "batch prefill s", "TTFT p50 ms", "TPOT p50 ms",
             "decode step p50 ms")
    head = (["batch", "who"] + list(phase)
            + ["decode step / roofline", "batch prefill / roofline"])
    print(" | ".join(head))
    for r in rows:
        for who, m in (("deepserve", r["ours"]), ("hf", r["hf"])):
            if m:
                print(" | ".join([str(r["batch"]), who] + _phase_cells(r, m) + [
                    f"{m['decode_step_s'] / r['decode_roofline_s']:.2f}",
                    f"{m['prefill_s'] / r['prefill_roofline_s']:.2f}"]))
        if r["hf"]:
            o, h = r["ours"], r["hf"]
            print(f"{r['batch']} | hf/deepserve | prefill x{h['prefill_s'] / o['prefill_s']:.2f}"
                  f" | decode step x{h['decode_step_s'] / o['decode_step_s']:.2f}"
                  f" | TTFT x{h['ttft_s'] / o['ttft_s']:.2f} | TPOT x{h['tpot_s'] / o['tpot_s']:.2f}")
    print(f"roofline per batch: " + ", ".join(
        f"B={r['batch']}: decode step {r['decode_roofline_s'] * 1e3:.1f} ms, "
        f"prefill {r['prefill_roofline_s']:.2f} s" for r in rows))


if __name__ == "__main__":
    main()
