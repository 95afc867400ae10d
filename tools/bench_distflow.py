"""Benchmark DistFlow against a plain memcpy of the same bytes.

    .venv/bin/python tools/bench_distflow.py [--sizes 1,4,16,64,256] [--reps 5] [--curve]

Two bf16 KV pools (2, L, H, NB, bs, D) live in named shared-memory segments
of this process. For each size, a run of consecutive blocks goes from the
source pool into the destination pool (at a different block offset) through
the shm backend (direct copy), the ring backend (staging segment + receiver
thread) and the tcp backend (ZeroMQ on 127.0.0.1 + receiver thread), and a
torch `copy_` of the same number of contiguous bytes between the same two
segments is the memcpy baseline. Each figure is the median over `reps`
timed repetitions after one warm-up; all pages are touched before timing.
--curve adds the tcp backend with CURVE on ([cluster] secure = true: a second
receiver and link made with a throwaway cluster key), timed in rounds
alternating with plain tcp (tcp, curve, tcp, curve, ...).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
import uuid

import torch

from deepserve.ipc import curve, curve_keys
from deepserve.ipc.segments import create_segment, segment_name, unlink_segment
from deepserve.transfer import DistFlow, DistFlowReceiver, PeerEndpoint, PoolRegion
from deepserve.transfer.receiver import LOOPBACK

L, H, BS, D = 4, 4, 16, 128  # a block id spans 2*L*H rows of BS*D bf16 = 128 KiB
DTYPE = torch.bfloat16
DST_OFFSET = 32  # destination blocks start here


def block_bytes() -> int:
    return 2 * L * H * BS * D * DTYPE.itemsize


def median_s(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def alternating_medians(fns: dict, reps: int) -> dict[str, float]:
    """Each fn warmed up once, then timed in rounds (a, b, a, b, ...): their medians."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def curve_receiver(dst, flow: DistFlow, name: str, keys_dir: str) -> DistFlowReceiver:
    """A receiver on `dst` and the link "curve" to it, both made secure."""
    os.environ[curve.ENV_VAR], os.environ[curve.NODE_ENV_VAR] = keys_dir, "bench"
    try:
        receiver = DistFlowReceiver(dst, bind=LOOPBACK)  # tcp, as across hosts (CURVE on it)
        flow.link("curve", receiver.endpoint(name), "tcp")
    finally:
        del os.environ[curve.ENV_VAR], os.environ[curve.NODE_ENV_VAR]
    return receiver


def make_pool(name: str, num_blocks: int):
    shape = (2, L, H, num_blocks, BS, D)
    seg = create_segment(name, math.prod(shape) * DTYPE.itemsize)
    return seg, torch.frombuffer(seg.buf, dtype=DTYPE).view(shape)


def bench(sizes_mib: list[int], reps: int, tcp_max_mib: int, with_curve: bool = False
          ) -> list[tuple]:
    run_id = "bench" + uuid.uuid4().hex[:6]
    num_blocks = max(sizes_mib) * (1 << 20) // block_bytes() + 2 * DST_OFFSET
    names = [segment_name(run_id, "src-kv"), segment_name(run_id, "dst-kv")]
    (sseg, src), (dseg, dst) = make_pool(names[0], num_blocks), make_pool(names[1], num_blocks)
    src.uniform_()
    dst.zero_()
    flow = DistFlow(src, timeout_s=120.0)
    receiver = DistFlowReceiver(dst, bind=LOOPBACK)  # tcp, not a one-host TE's ipc://
    secured, keys = None, tempfile.TemporaryDirectory()
    rows = []
    try:
        for peer, backend in (("shm", "shm"), ("ring", "ring"), ("tcp", "tcp")):
            flow.link(peer, receiver.endpoint(names[1]), backend)
        if with_curve:
            curve_keys.make_keys(f"{keys.name}/k")
            curve_keys.make_node_key(f"{keys.name}/k", "bench")
            secured = curve_receiver(dst, flow, names[1], f"{keys.name}/k")
        src_flat, dst_flat = src.view(-1), dst.view(-1)
        for mib in sizes_mib:
            n = mib * (1 << 20) // block_bytes()
            numel = n * block_bytes() // DTYPE.itemsize
            s_reg, d_reg = PoolRegion(list(range(n))), PoolRegion(list(range(DST_OFFSET, DST_OFFSET + n)))

            def memcpy():
                dst_flat[-numel:].copy_(src_flat[:numel])  # other bytes than the transfer

            def via(peer):
                return lambda: flow.transfer(peer, s_reg, d_reg).wait()

            reps_here = reps if mib <= 64 else max(2, reps // 2)
            t = {"memcpy": median_s(memcpy, reps_here)}
            for peer in ("shm", "ring"):
                t[peer] = median_s(via(peer), reps_here)
            t["tcp"] = t["curve"] = None
            if mib <= tcp_max_mib:
                peers = {"tcp": via("tcp")} | ({"curve": via("curve")} if with_curve else {})
                t.update(alternating_medians(peers, max(2, reps_here // 2)))
            assert torch.equal(dst[:, :, :, DST_OFFSET:DST_OFFSET + n], src[:, :, :, :n])
            rows.append((mib, n * block_bytes(), t))
    finally:
        flow.close()
        receiver.close()
        if secured is not None:
            secured.close()
        keys.cleanup()
        del src, dst, src_flat, dst_flat
        for seg, name in ((sseg, names[0]), (dseg, names[1])):
            seg.close()
            unlink_segment(name)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4,16,64,256", help="MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tcp-max-mib", type=int, default=256, help="skip tcp above this size")
    ap.add_argument("--curve", action="store_true", help="also tcp with CURVE ([cluster] secure)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"pool (2, {L}, {H}, NB, {BS}, {D}) {DTYPE}, block = {block_bytes() >> 10} KiB, "
          f"torch threads = {torch.get_num_threads()}")
    print(f"{'size':>8} | {'memcpy GB/s':>11} | {'shm GB/s':>8} | {'shm/memcpy':>10} | "
          f"{'ring GB/s':>9} | {'tcp GB/s':>8}" + (" | curve GB/s | curve/tcp" if args.curve else ""))
    for mib, nbytes, t in bench(sizes, args.reps, args.tcp_max_mib, args.curve):
        gbs = {k: (nbytes / v / 1e9 if v else None) for k, v in t.items()}
        tcp = f"{gbs['tcp']:8.2f}" if gbs["tcp"] else f"{'-':>8}"
        line = (f"{mib:>4} MiB | {gbs['memcpy']:11.2f} | {gbs['shm']:8.2f} | "
                f"{gbs['shm'] / gbs['memcpy']:10.2f} | {gbs['ring']:9.2f} | {tcp}")
        if args.curve:
            line += (f" | {gbs['curve']:10.3f} | {gbs['curve'] / gbs['tcp']:9.2f}"
                     if gbs["curve"] else f" | {'-':>10} | {'-':>9}")
        print(line)


if __name__ == "__main__":
    main()
