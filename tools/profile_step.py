"""Time (and optionally profile) one decode step: the ModelRunner alone, or a whole TE.

The KV pool is filled with random values instead of being prefilled (the
cost of a decode step does not depend on what the keys say), so a batch-32
step at context ~530 can be timed in seconds rather than after a 40 s
prefill. Prints the median step time over --steps steps; with --profile,
the torch profiler's self-CPU table of one step.

    python tools/profile_step.py --model models/small --batch 32 --ctx 530 [--profile]

--engine instead runs a TE of processes (master, tokenizer, worker) on
--batch-sizes batches of --prompt-len random-id prompts and --gen-len
greedy tokens each, with the step timeline on (src/deepserve/ipc/timeline.py),
and prints where each decode step's wall time goes, part by part and
process by process (tools/step_timeline.py), with --png a picture of three
steps per batch size:

    python tools/profile_step.py --engine --batch-sizes 1,8,32 --png step-timeline.png
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import NewSeq, ScheduledSeq, StepBatch
from deepserve.model.loader import load_model
from deepserve.worker.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import step_timeline  # noqa: E402


def decode_batch(step_id: int, batch: int, ctx: int, block_size: int, *,
                 first: bool) -> StepBatch:
    """One decode token per sequence at position ctx - 1; sequence i owns the
    blocks i*nb+1 .. (block 0 unused), so tables are disjoint and in order."""
    nb = -(-ctx // block_size)
    seqs = [ScheduledSeq(i, ctx - 1, [100 + i], list(range(1 + i * nb, 1 + (i + 1) * nb)), True)
            for i in range(batch)]
    greedy = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    new = [NewSeq(i, greedy) for i in range(batch)] if first else []
    return StepBatch(step_id, seqs, new)


def build_runner(model_dir: Path, dtype: str, batch: int, ctx: int, block_size: int):
    model = load_model(model_dir, dtype)
    nb = -(-ctx // block_size)
    runner = ModelRunner(model, batch * nb + 1, block_size)
    gen = torch.Generator().manual_seed(0)
    runner.kv_pool.copy_(torch.randn(runner.kv_pool.shape, generator=gen))
    return runner


def time_steps(runner: ModelRunner, batch: int, ctx: int, num_steps: int) -> list[float]:
    runner.execute(decode_batch(0, batch, ctx, runner.block_size, first=True))  # warm-up
    times = []
    for step in range(1, num_steps + 1):
        b = decode_batch(step, batch, ctx, runner.block_size, first=False)
        t = time.perf_counter()
        runner.execute(b)
        times.append(time.perf_counter() - t)
    return times


@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=ROOT / "models" / "small")
@click.option("--dtype", default="bfloat16")
@click.option("--batch", default=32)
@click.option("--ctx", default=530, help="context length of every sequence, new token included")
@click.option("--block-size", default=16)
@click.option("--steps", default=10)
@click.option("--threads", default=0, help="torch threads (0: torch's default)")
@click.option("--profile", is_flag=True, help="print the profiler's table of one step")
@click.option("--engine", is_flag=True, help="a whole TE of processes: the step timeline")
@click.option("--batch-sizes", default="1,8,32", help="with --engine")
@click.option("--prompt-len", default=512, help="with --engine")
@click.option("--gen-len", default=64, help="with --engine")
@click.option("--png", type=click.Path(path_type=Path), default=None, help="with --engine")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help="with --engine")
def main(model, dtype, batch, ctx, block_size, steps, threads, profile, engine, batch_sizes,
         prompt_len, gen_len, png, json_out):
    if engine:
        sizes = [int(b) for b in batch_sizes.split(",")]
        results = engine_timeline(model, dtype, sizes, prompt_len, gen_len, threads)
        step_timeline.print_table(results, f"{model.name} {dtype} prompt {prompt_len} ")
        if json_out:
            json_out.write_text(json.dumps(results, indent=1))
        if png:
            step_timeline.plot(results, png, f"TE step timeline, {model.name} {dtype}, "
                                             f"{prompt_len}-token prompts")
            print(f"wrote {png}")
        return
    if threads:
        torch.set_num_threads(threads)
    runner = build_runner(model, dtype, batch, ctx, block_size)
    times = time_steps(runner, batch, ctx, steps)
    print(f"batch {batch} ctx {ctx}: step median {statistics.median(times) * 1e3:.1f} ms "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}) over {steps} steps")
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.execute(decode_batch(steps + 1, batch, ctx, block_size, first=False))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def engine_timeline(model: Path, dtype: str, sizes: list[int], prompt_len: int, gen_len: int,
                    threads: int) -> list[dict]:
    """One TE of processes per batch size (its spans are written when it
    stops), the timeline of its decode steps."""
    import bench_runs
    from deepserve import LLM
    from deepserve.ipc.timeline import read_spans
    from deepserve.model.config import load_model_config

    vocab = load_model_config(model, dtype).vocab_size
    prompts = bench_runs.benchmark_prompts(vocab, sizes, prompt_len)
    results = []
    for b in sizes:
        with tempfile.TemporaryDirectory(prefix="ds-timeline-") as folder:
            llm = LLM(str(model), dtype=dtype, processes=True, enable_prefix_caching=False,
                      max_num_batched_tokens=2048, num_threads=threads or None,
                      num_kv_blocks=b * -(-(prompt_len + gen_len) // 16) + 1,
                      timeline_dir=folder)
            try:
                bench_runs.run_ours(llm, prompts[b], gen_len)
                memory = worker_memory(llm, model)
            finally:
                llm.shutdown()
            results.append({**step_timeline.analyse(read_spans(Path(folder)), b), **memory})
    return results


def worker_memory(llm, model: Path) -> dict:
    """The worker's resident size against what it must hold: the weights (the
    checkpoint's bytes) and its KV pool."""
    import psutil

    [worker] = [c for c in llm.client.launcher.children if c.name.startswith("worker")]
    config = llm.client.config
    from deepserve.model.config import load_model_config
    kv = config.num_kv_blocks * load_model_config(model, config.dtype).kv_bytes_per_block(
        config.block_size, config.tp)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    return {"worker_rss": psutil.Process(worker.process.pid).memory_info().rss,
            "weights_bytes": weights, "kv_bytes": kv}


if __name__ == "__main__":
    main()
