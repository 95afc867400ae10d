"""The machine's limits for tools/bench_engine.py: memory bandwidth, matmul
peak, and what they imply for one decode step and one batch prefill.

    decode step limit = max(bytes read / read bandwidth, FLOPs / peak)
    prefill limit     = FLOPs / peak

peak is the best matmul rate measured here: fp32 (MKL sgemm, 2048^3) or
torch's bf16 matmul (a 512 x 896 x 4864 prefill-shaped product), whichever
is higher. On a CPU without bf16 arithmetic (AVX2 only) bf16 work runs in
fp32 lanes and sgemm is the ceiling; on one with AVX512_BF16 or AMX the bf16
GEMM is several times faster and sets it. Either is a measured rate, not the
silicon's: an engine with better GEMM kernels can beat it (ratio < 1).
"""

from __future__ import annotations

import time

import torch


def _best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_machine() -> dict:
    """read / copy GB/s over 256 MiB, fp32 sgemm and torch bf16 matmul TFLOP/s."""
    src = torch.ones(256 << 20, dtype=torch.uint8).view(torch.bfloat16)
    dst = torch.empty_like(src)
    read = src.nbytes / _best(src.sum)
    copy = 2 * src.nbytes / _best(lambda: dst.copy_(src))
    a32 = torch.randn(2048, 2048)
    sgemm = 2 * 2048 ** 3 / _best(lambda: a32 @ a32)
    a16 = torch.randn(512, 896, dtype=torch.bfloat16)
    b16 = torch.randn(896, 4864, dtype=torch.bfloat16)
    bf16 = 2 * 512 * 896 * 4864 / _best(lambda: a16 @ b16, repeat=2)
    return {"read_gbps": read / 1e9, "copy_gbps": copy / 1e9, "sgemm_tflops": sgemm / 1e12,
            "torch_bf16_tflops": bf16 / 1e12, "peak_tflops": max(sgemm, bf16) / 1e12,
            "threads": torch.get_num_threads()}


def model_numbers(cfg) -> dict:
    """Weight bytes one decode step reads, KV bytes per token, linear params."""
    e, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    per_layer = e * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * e + 3 * e * i
    head = cfg.vocab_size * e  # lm_head: read every step, used by sampled rows only
    size = cfg.dtype.itemsize
    return {"weight_bytes": (layers * per_layer + head) * size,
            "kv_bytes_per_token": 2 * layers * cfg.kv_size * size,
            "layer_params": layers * per_layer, "head_params": head,
            "layers": layers, "q_size": cfg.q_size}


def limits(nums: dict, machine: dict, batch: int, prompt_len: int, gen_len: int) -> dict:
    """Seconds: one decode step at the mean context, one whole-batch prefill."""
    peak = machine["peak_tflops"] * 1e12
    ctx = prompt_len + gen_len / 2
    step_bytes = nums["weight_bytes"] + batch * ctx * nums["kv_bytes_per_token"]
    step_flops = 2 * batch * (nums["layer_params"] + nums["head_params"]) + \
        4 * nums["layers"] * nums["q_size"] * batch * ctx
    prefill_flops = 2 * nums["layer_params"] * batch * prompt_len + \
        2 * nums["head_params"] * batch + \
        4 * nums["layers"] * nums["q_size"] * batch * prompt_len * prompt_len / 2
    return {"decode_step_s": max(step_bytes / (machine["read_gbps"] * 1e9), step_flops / peak),
            "decode_bound": "memory" if step_bytes / (machine["read_gbps"] * 1e9) >
            step_flops / peak else "compute",
            "prefill_s": prefill_flops / peak}


def describe(machine: dict) -> str:
    return (f"machine: read {machine['read_gbps']:.1f} GB/s, copy {machine['copy_gbps']:.1f} GB/s, "
            f"fp32 sgemm {machine['sgemm_tflops'] * 1e3:.0f} GFLOP/s, torch bf16 matmul "
            f"{machine['torch_bf16_tflops'] * 1e3:.0f} GFLOP/s (peak: the higher); "
            f"torch threads {machine['threads']}")
