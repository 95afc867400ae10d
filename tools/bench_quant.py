"""Quantized weights against bf16, same engine, same run (issue 48).

Two numbers per mode (bf16, and each --modes entry: int8, int4), engines in this
process, rounds interleaved (bf16, int8, bf16, int8, ...):

  * decode step at batch 1: (time to generate 1 + N tokens - time to
    generate 1) / N, greedy, EOS ignored, after a --prompt-len token prompt;
    median over --rounds with min-max, and the ratio to bf16 per round;
  * perplexity of tools/data/declaration.txt (the US Declaration of
    Independence, 1776, public domain) from the prompt logprobs of windows of
    --window tokens: exp(mean negative log-likelihood), and its change
    against bf16 (the quality bars: int8 within 1 %, int4 within 10 %). A window's prefill goes
    to torch on the dequantized weights where torch wins past a few rows
    (kernels.kernel_max_rows, CPUs with bf16 arithmetic), so each quantized
    mode is also measured with the kernel at every size ("MODE all-kernel"):
    the arithmetic a decode step uses (on AVX-512 VNNI: int8 activations too).

    python tools/bench_quant.py [--model models/smollm2-135m-instruct] [--modes int8,int4]
        [--rounds 5]

Prints the CPU (model name and whether it has AVX512_BF16 / VNNI) and a table.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import click
import torch

from deepserve import LLM, SamplingParams
from deepserve.model import kernels

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tools" / "data" / "declaration.txt"


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown CPU")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    has = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni")
           if f" {f}" in flags]
    return f"{name} ({', '.join(has)}), {torch.get_num_threads()} torch threads"


def decode_step_s(llm: LLM, prompt: list[int], steps: int) -> float:
    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start
    run(1)  # warm (also fills the prefix cache alike for both runs below)
    return (run(1 + steps) - run(1)) / steps


def perplexity(llm: LLM, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        [out] = llm.generate([chunk], params)
        lps = [t.logprob for t in out.prompt_logprobs]
        nll -= sum(lps)
        count += len(lps)
    return math.exp(nll / count)


@click.command()
@click.option("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
@click.option("--modes", default="int8", help="comma-separated quantize modes besides bf16")
@click.option("--rounds", default=5, show_default=True)
@click.option("--prompt-len", default=64, show_default=True)
@click.option("--steps", default=64, show_default=True, help="decode steps timed per round")
@click.option("--window", default=512, show_default=True, help="perplexity window (tokens)")
def main(model: str, modes: str, rounds: int, prompt_len: int, steps: int, window: int) -> None:
    names = ["bf16", *[m for m in modes.split(",") if m]]
    engines = {n: LLM(model, dtype="bfloat16", quantize="" if n == "bf16" else n,
                      num_kv_blocks=512, enable_prefix_caching=False) for n in names}
    tokenizer = engines["bf16"].tokenizer
    text_ids = tokenizer.encode(TEXT.read_text())
    prompt = text_ids[:prompt_len]
    steps_s: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            steps_s[n].append(decode_step_s(engines[n], prompt, steps))
    ppl = {n: perplexity(engines[n], text_ids, window) for n in names}
    for llm in engines.values():
        llm.shutdown()
    if kernels.kernel_max_rows() is not None:
        kernels.kernel_max_rows = lambda: None  # the kernel at every size from here on
        for n in names[1:]:
            llm = LLM(model, dtype="bfloat16", quantize=n, num_kv_blocks=512,
                      enable_prefix_caching=False)
            ppl[f"{n} all-kernel"] = perplexity(llm, text_ids, window)
            llm.shutdown()
    print(f"CPU: {cpu()}; int8 path: "
          f"{kernels.int8_isa() if kernels.int8_activations() else 'fp32 activations'}")
    print(f"model: {model}; {rounds} rounds interleaved; prompt {prompt_len} tokens, "
          f"{steps} decode steps timed; perplexity over {len(text_ids)} tokens of "
          f"{TEXT.name}, windows of {window}")
    print(f"{'weights':<8} {'decode step ms p50 (min-max)':<30} {'speed vs bf16 p50 (min-max)':<30}"
          f" {'perplexity':>10} {'vs bf16':>8}")
    for n in ppl:
        ms = [s * 1e3 for s in steps_s.get(n, [])]
        ratios = [b / s for b, s in zip(steps_s["bf16"], steps_s.get(n, []))]
        timing = (f"{statistics.median(ms):8.2f} ({min(ms):.2f}-{max(ms):.2f}){'':<11}"
                  f" {statistics.median(ratios):6.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                  if ms else f"{'':<30} {'':<18}")
        print(f"{n:<8} {timing}{'':<13} {ppl[n]:10.3f} {100 * (ppl[n] / ppl['bf16'] - 1):+7.2f}%")


if __name__ == "__main__":
    main()
