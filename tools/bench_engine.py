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
    first, last, counts = {}, {}, {i: 0 for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            counts[out.request_id] = len(out.token_ids)
    assert all(c == gen_len for c in counts.values()), counts
    return _summary(start, [first[i] for i in ids], [last[i] for i in ids], gen_len)


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
    end = time.perf_counter()
    assert out.shape[1] == ids.shape[1] + gen_len
    # Token k is known when step k+1's logits arrive; the last when generate returns.
    done = stamps[1:] + [end]
    return _summary(start, [done[0]] * len(prompts), [done[-1]] * len(prompts), gen_len)


def _summary(start: float, first: list[float], last: list[float], gen_len: int) -> dict:
    ttft = [f - start for f in first]
    tpot = [(l - f) / (gen_len - 1) for f, l in zip(first, last)]
    batch, prefill_s = len(first), max(first) - start
    decode_s = max(last) - max(first)
    return {"ttft_s": statistics.median(ttft), "tpot_s": statistics.median(tpot),
            "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_tok_s": batch * (gen_len - 1) / max(sum(tpot) / batch * (gen_len - 1), 1e-9)}


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
    roof_tpot = step_bytes / (machine["read_gbps"] * 1e9)
    roof_prefill = prefill_flops(nums, batch, prompt_len) / (machine["matmul_tflops"] * 1e12)
    row = {"batch": batch, "ours": ours, "hf": theirs,
           "decode_roofline_tpot_s": roof_tpot, "prefill_roofline_s": roof_prefill,
           "prefill_tok_s": batch * prompt_len / ours["prefill_s"],
           "decode_tok_s": batch / ours["tpot_s"]}
    if theirs:
        row.update(hf_prefill_tok_s=batch * prompt_len / theirs["prefill_s"],
                   hf_decode_tok_s=batch / theirs["tpot_s"])
    return row


def _print_table(rows: list[dict]) -> None:
    head = ("batch", "prefill tok/s", "decode tok/s", "TTFT p50 ms", "TPOT p50 ms",
            "HF prefill tok/s", "HF decode tok/s", "HF TTFT ms", "HF TPOT ms",
            "prefill x HF", "decode x HF", "TPOT/roofline", "prefill/roofline")
    print(" | ".join(head))
    for r in rows:
        o, h = r["ours"], r["hf"] or {}
        cells = [r["batch"], f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}",
                 f"{o['ttft_s'] * 1e3:.0f}", f"{o['tpot_s'] * 1e3:.1f}"]
        if h:
            cells += [f"{r['hf_prefill_tok_s']:.0f}", f"{r['hf_decode_tok_s']:.1f}",
                      f"{h['ttft_s'] * 1e3:.0f}", f"{h['tpot_s'] * 1e3:.1f}",
                      f"{h['prefill_s'] / o['prefill_s']:.2f}", f"{h['tpot_s'] / o['tpot_s']:.2f}"]
        else:
            cells += ["-"] * 6
        cells += [f"{o['tpot_s'] / r['decode_roofline_tpot_s']:.2f}",
                  f"{o['prefill_s'] / r['prefill_roofline_s']:.2f}"]
        print(" | ".join(str(c) for c in cells))


if __name__ == "__main__":
    main()
