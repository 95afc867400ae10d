"""The remote KV tier against recompute, per prefix length, side by side.

    python tools/bench_remote_tier.py [--model models/small] [--sizes 512,2048,8192]
        [--rounds 3] [--json remote.json]

For each prefix of N tokens, interleaved (every size, both ways, each round):
  recompute  the prefill of N fresh tokens on this machine's engine (the
             in-process API, one TE, prefix caching off): what a TE does when
             no tier holds the prefix (time to the first token, max_tokens = 1)
  remote     a tier service ("host B") answering a TE's TierLookup for the N/16
             blocks of that prefix that only another tier service ("host A")
             holds: PeerGet over loopback tcp, the blocks written into B's host
             pool, the lookup answered (tiers/remote_tier.py); the blocks have
             the model's geometry (--model's config) and fresh hashes each round
The remote time ends where the TE's host-tier load begins (host -> device,
measured by tools/bench_tiers.py); both tier services run as threads of this
process on 127.0.0.1, so the "link" is loopback on a 2-core machine.
Reports medians (min-max) over rounds, the tokens the fetch brought (fewer
than asked when it ran past its budget, 0.6 s: the TE computes the rest) and
the ratio recompute / remote. Each measurement starts SETTLE_S after the last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from deepserve import LLM, SamplingParams
from deepserve.errors import PromptTooLongError
from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket, free_port, ipc_address
from deepserve.messages.cache import (NO_SLOT, BlockGeometry, FromTier, TierCommit,
                                      TierCommitted, TierLookup, TierRelease, TierReport,
                                      TierReserve)
from deepserve.model.config import load_model_config
from deepserve.tiers import block_file
from deepserve.tiers.tier_server import TierServer
from deepserve.tiers.tier_settings import TierSettings

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
SETTLE_S = 0.5
"""Before each measurement: the other's threads (torch's spinning ones) go quiet."""
_hashes = itertools.count(1 << 40)


class Service:
    """A tier service on a thread (its loop owns its sockets)."""

    def __init__(self, settings: TierSettings):
        self.settings, self.stop_flag = settings, threading.Event()
        up = threading.Event()

        def run() -> None:
            ctx = zmq.Context()
            server = TierServer(settings, ctx)
            self.server = server
            up.set()
            try:
                while not self.stop_flag.is_set():
                    server.step()
            finally:
                server.close()
                ctx.term()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        up.wait(10)

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(10)


def geometry_of(model: Path) -> BlockGeometry:
    c = load_model_config(model)
    return BlockGeometry(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                         block_size=BLOCK, head_dim=c.head_dim, dtype="bfloat16")


class Hosts:
    """Host A holds the blocks; host B's lookups fetch them (both on loopback tcp)."""

    def __init__(self, geometry: BlockGeometry, pool_bytes: int, run_dir: str):
        self.ctx, self.geometry = zmq.Context(), geometry
        self.pub = pub = f"tcp://127.0.0.1:{free_port()}"
        self.peers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.a, self.b = (Service(TierSettings(inbox=ipc_address(run_dir, f"kv{i}"),
                                               run_id=f"brt{i}{free_port()}",
                                               host_bytes=pool_bytes, peer=p, cm_pub=pub))
                          for i, p in enumerate(self.peers))
        self.reply = ipc_address(run_dir, "me")
        self.back = PullSocket(self.ctx, self.reply, bind=True, type=FromTier)
        self.to = {name: PushSocket(self.ctx, s.settings.inbox, bind=False)
                   for name, s in (("a", self.a), ("b", self.b))}
        for name in ("a", "b"):  # each makes its pool on its first lookup
            self.lookup(name, [1])
        self._relaying = threading.Event()
        self._relay = threading.Thread(target=self._relay_reports, daemon=True)
        self._relay.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (self.b.server.remote.peers
                                                   and self.a.server.remote.peers):
            time.sleep(0.05)

    def _relay_reports(self) -> None:
        """What the CM does for a cluster: every tier service's report (its peer
        address) relayed on the PUB, every REPORT_S; its own socket on this thread."""
        cm = PubSocket(self.ctx, self.pub)
        try:
            while not self._relaying.wait(0.2):
                for peer in self.peers:
                    cm.put(TierReport(peer=peer))
        finally:
            cm.close()

    def lookup(self, name: str, hashes: list[int]):
        self.to[name].put(TierLookup(lookup_id=1, model_key="m", geometry=self.geometry,
                                     hashes=hashes, reply_to=self.reply))
        return self.back.get(timeout=30)

    def hold_on_a(self, hashes: list[int]) -> None:
        self.to["a"].put(TierReserve(reserve_id=1, model_key="m", geometry=self.geometry,
                                     hashes=hashes, reply_to=self.reply))
        reserved = self.back.get(timeout=30)
        slots = [s for s in reserved.slots if s != NO_SLOT]
        pool = self.a.server.pools["m"].slots
        for s in slots:
            pool[s] = np.random.randint(0, 255, pool.shape[1], dtype=np.uint8)
        self.to["a"].put(TierCommit(lease_id=reserved.lease_id, model_key="m", slots=slots,
                                    reply_to=self.reply, reserve_id=1))
        assert isinstance(self.back.get(timeout=30), TierCommitted)

    def remote(self, num_tokens: int) -> tuple[float, int]:
        """(seconds to the lookup's answer, blocks it got: fewer than asked when the
        fetch ran past its budget, remote_tier.py)."""
        hashes = [next(_hashes) for _ in range(num_tokens // BLOCK)]
        self.hold_on_a(hashes)
        time.sleep(SETTLE_S)
        started = time.perf_counter()
        hits = self.lookup("b", hashes)
        elapsed = time.perf_counter() - started
        self.to["b"].put(TierRelease(lease_id=hits.lease_id, model_key="m"))  # as a TE, loaded
        return elapsed, len(hits.slots)

    def close(self) -> None:
        self._relaying.set()
        self._relay.join(5)
        self.a.stop()
        self.b.stop()
        for sock in (self.back, *self.to.values()):
            sock.close()
        self.ctx.term()


def recompute_s(llm: LLM, vocab: int, num_tokens: int, rng: np.random.Generator
                ) -> float | None:
    """Seconds to prefill num_tokens fresh tokens; None: longer than the model takes."""
    ids = rng.integers(100, vocab - 100, num_tokens).tolist()
    time.sleep(SETTLE_S)
    started = time.perf_counter()
    try:
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    except PromptTooLongError:
        return None
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "small"))
    p.add_argument("--sizes", default="512,2048,8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model = Path(args.model)
    geometry = geometry_of(model)
    block_bytes = block_file.block_nbytes(geometry)
    vocab = load_model_config(model).vocab_size
    llm = LLM(str(model), num_kv_blocks=max(sizes) // BLOCK + 64, enable_prefix_caching=False,
              max_num_batched_tokens=2048)
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="brt", dir="/tmp") as run_dir:
        hosts = Hosts(geometry, (max(sizes) // BLOCK + 8) * block_bytes * 2, run_dir)
        try:
            recompute_s(llm, vocab, 64, rng)  # warm-up
            hosts.remote(BLOCK * 4)
            for r in range(args.rounds):
                for n in sizes:
                    rows.append({"round": r, "tokens": n, "way": "recompute",
                                 "seconds": recompute_s(llm, vocab, n, rng)})
                    seconds, blocks = hosts.remote(n)
                    rows.append({"round": r, "tokens": n, "way": "remote", "seconds": seconds,
                                 "blocks": blocks, "bytes": blocks * block_bytes})
                    print(json.dumps(rows[-2]), json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            hosts.close()
            llm.shutdown()
    print(f"model {model.name}: {block_bytes} bytes a {BLOCK}-token block; {args.rounds} rounds")
    print("| prefix tokens | MB | recompute s, median [min-max] | remote s | tokens fetched |"
          " recompute / remote | remote GB/s |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        rec = [x["seconds"] for x in rows if x["tokens"] == n and x["way"] == "recompute"
               and x["seconds"] is not None]
        rem = [x for x in rows if x["tokens"] == n and x["way"] == "remote"]
        secs = [x["seconds"] for x in rem]
        got = [x["blocks"] * BLOCK for x in rem]
        mb = statistics.median(x["bytes"] for x in rem) / 1e6
        recompute = (f"{statistics.median(rec):.3f} [{min(rec):.3f}-{max(rec):.3f}]" if rec
                     else "past the model's max_model_len")
        ratio = f"{statistics.median(rec) / statistics.median(secs):.1f}" if rec else "-"
        print(f"| {n} | {n // BLOCK * block_bytes / 1e6:.1f} | {recompute} | "
              f"{statistics.median(secs):.3f} [{min(secs):.3f}-{max(secs):.3f}] | "
              f"{statistics.median(got):.0f} [{min(got)}-{max(got)}] | "
              f"{ratio} | {mb / 1e3 / statistics.median(secs):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
