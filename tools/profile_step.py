"""Time (and optionally profile) one decode step of the ModelRunner directly.

The KV pool is filled with random values instead of being prefilled (the
cost of a decode step does not depend on what the keys say), so a batch-32
step at context ~530 can be timed in seconds rather than after a 40 s
prefill. Prints the median step time over --steps steps; with --profile,
the torch profiler's self-CPU table of one step.

    python tools/profile_step.py --model models/small --batch 32 --ctx 530 [--profile]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import torch

from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import NewSeq, ScheduledSeq, StepBatch
from deepserve.model.loader import load_model
from deepserve.worker.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]


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
def main(model, dtype, batch, ctx, block_size, steps, threads, profile):
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


if __name__ == "__main__":
    main()
