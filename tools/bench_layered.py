"""Layer-wise KV loads against whole-block loads: a prefill whose prefix is on disk.

    python tools/bench_layered.py [--model models/mini-16k] [--hit 8176]
        [--misses 16,2048] [--layers 2] [--storage-gbps 0.02] [--rounds 3]
        [--json layered.json]

One tier service (a thread of this process; a disk tier and a small host tier)
and three process-mode TEs on it, each through its own storage bucket:
  writer   computes each fresh prompt, so its blocks reach the disk tier
  layered  kv_load_layers = --layers: its disk hits are read a layer at a time,
           the first --layers before the request queues, the rest while its
           prefill computes (worker/layer_loads.py)
  whole    kv_load_layers = 0: the hits are read whole, then the prefill runs
Each measurement is a fresh prompt of --hit tokens (whole blocks, on disk only:
the writer's next two prompts pushed them out of a host tier of 1.5 prompts; a
smaller one cannot take a whole prompt on its way to disk) plus `misses` fresh
tokens, sent with max_tokens 1; the time is its time to the first token. The
modes alternate (layered, whole, whole, layered, ...) round after round.

Per row it also reports the two bounds a layer-wise load is held to:
  read     the hit's bytes at the bucket's rate (--storage-gbps)
  compute  the same TE's prefill of `misses` fresh tokens after the --hit
           prefix, with that prefix in its device pool (measured right after)
and ratio = layered / max(read, compute): 1.0 is a perfect overlap. The ring
holds --layers layers of the hit (the whole hit's bytes x layers / L).
The default model is the mini preset (16 layers) with 16384 positions,
generated into models/mini-16k by tools/make_model.py when missing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from deepserve import LLM, SamplingParams
from deepserve.ipc.sockets import ipc_address
from deepserve.model.config import load_model_config
from deepserve.tiers.tier_server import TierServer
from deepserve.tiers.tier_settings import TierSettings

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
SETTLE_S = 1.0  # before each measurement: the disk writer and torch's threads go quiet
FIRST = SamplingParams(temperature=0, max_tokens=1)


def model_dir(path: Path) -> Path:
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(path),
                        "--preset", "mini", "--max-position", "16384"], check=True)
    return path


class Service:
    """The tier service on a thread (its loop owns its sockets)."""

    def __init__(self, settings: TierSettings):
        self.settings, self.stop_flag, up = settings, threading.Event(), threading.Event()

        def run() -> None:
            ctx = zmq.Context()
            self.server = TierServer(settings, ctx)
            up.set()
            try:
                while not self.stop_flag.is_set():
                    self.server.step()
            finally:
                self.server.close()
                ctx.term()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        up.wait(10)

    def disk_files(self) -> int:
        return sum(1 for _ in Path(self.settings.disk_dir).rglob("*.kv"))

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(10)


def wait_disk(service: Service, want: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while service.disk_files() < want and time.monotonic() < deadline:
        time.sleep(0.2)
    if service.disk_files() < want:
        raise SystemExit(f"only {service.disk_files()} of {want} blocks reached the disk tier")


def fresh(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def timed(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    time.sleep(SETTLE_S)
    start = time.perf_counter()
    out = llm.generate([prompt], FIRST)[0]
    return time.perf_counter() - start, out.cached_tokens


def run(args) -> list[dict]:
    model = model_dir(Path(args.model))
    cfg = load_model_config(model)
    token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.dtype.itemsize
    block_bytes = BLOCK * token_bytes
    misses = [int(m) for m in args.misses.split(",")]
    longest = args.hit + max(misses)
    num_blocks = 2 * (longest // BLOCK + 2)
    rng = random.Random(args.seed)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        service = Service(TierSettings(
            inbox=ipc_address(tmp, "kv"), run_id=f"bl{rng.randrange(1 << 20)}",
            host_bytes=(args.hit // BLOCK * 3 // 2) * block_bytes,  # 1.5 prompts
            disk_dir=str(Path(tmp) / "disk"),
            disk_bytes=64 * (longest // BLOCK + 1) * block_bytes))
        common = dict(processes=True, tier_address=service.settings.inbox,
                      cache_cost_model=False, num_kv_blocks=num_blocks,
                      max_num_batched_tokens=longest + BLOCK)
        llms = {"writer": LLM(str(model), **common),
                "layered": LLM(str(model), kv_load_layers=args.layers,
                               storage_read_gbps=args.storage_gbps, **common),
                "whole": LLM(str(model), storage_read_gbps=args.storage_gbps, **common)}
        try:
            order = [(r, m, mode) for r in range(args.rounds) for m in misses
                     for mode in (("layered", "whole") if r % 2 == 0 else ("whole", "layered"))]
            prefixes = [fresh(rng, args.hit, cfg.vocab_size) for _ in range(len(order) + 2)]
            write = llms["writer"]
            for prefix in prefixes[:2]:  # their blocks: host, then disk
                write.generate([prefix + [7]], FIRST)
            for i, (r, m, mode) in enumerate(order):
                write.generate([prefixes[i + 2] + [7]], FIRST)  # i leaves the host tier
                wait_disk(service, (i + 3) * (args.hit // BLOCK))
                rows.append(measure(llms[mode], mode, r, m, prefixes[i], rng, cfg, args,
                                    token_bytes))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for llm in llms.values():
                llm.shutdown()
            service.stop()
    return rows


def measure(llm: LLM, mode: str, r: int, m: int, prefix: list[int], rng, cfg, args,
            token_bytes: int) -> dict:
    ttft, cached = timed(llm, prefix + fresh(rng, m, cfg.vocab_size))
    compute, cached_again = timed(llm, prefix + fresh(rng, m, cfg.vocab_size))  # device hit
    hit_bytes = cached * token_bytes
    read = hit_bytes / (args.storage_gbps * 1e9)
    return {"mode": mode, "round": r, "hit_tokens": args.hit, "misses": m, "ttft_s": ttft,
            "cached_tokens": cached, "device_cached_tokens": cached_again,
            "read_s": read, "compute_s": compute, "ratio": ttft / max(read, compute),
            "staging_bytes": (hit_bytes * min(args.layers, cfg.num_layers) // cfg.num_layers
                              if mode == "layered" else None),  # whole: one block's bounce
            "hit_bytes": hit_bytes}


def staging(rows: list[dict]) -> str:
    """The layered ring's bytes; the whole-block path has none (a block's bounce buffer)."""
    sizes = [r["staging_bytes"] for r in rows if r["staging_bytes"] is not None]
    return f"{statistics.median(sizes) / 1e6:.1f}" if sizes else "-"


def table(rows: list[dict], args) -> str:
    def med(xs):
        xs = sorted(xs)
        return f"{statistics.median(xs):.2f} [{xs[0]:.2f}-{xs[-1]:.2f}]"

    out = ["| misses | mode | TTFT s | read s | compute s | TTFT / max(read, compute) | "
           "cached tokens | staging MB |", "|---|---|---|---|---|---|---|---|"]
    for m in sorted({row["misses"] for row in rows}):
        for mode in ("layered", "whole"):
            sel = [row for row in rows if row["misses"] == m and row["mode"] == mode]
            if not sel:
                continue
            out.append(f"| {m} | {mode} | {med([s['ttft_s'] for s in sel])} | "
                       f"{med([s['read_s'] for s in sel])} | "
                       f"{med([s['compute_s'] for s in sel])} | "
                       f"{med([s['ratio'] for s in sel])} | "
                       f"{statistics.median([s['cached_tokens'] for s in sel]):.0f} | "
                       f"{staging(sel)} |")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "mini-16k"))
    ap.add_argument("--hit", type=int, default=8176, help="prefix tokens on disk (whole blocks)")
    ap.add_argument("--misses", default="16,2048", help="fresh tokens after it, per row")
    ap.add_argument("--layers", type=int, default=2, help="the layered TE's ring of layers")
    ap.add_argument("--storage-gbps", type=float, default=0.02)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default=None, help="where the disk tier lives (default: /tmp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.hit % BLOCK or args.hit <= 0:
        ap.error(f"--hit must be a positive multiple of {BLOCK}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
