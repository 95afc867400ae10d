"""Scale-out speed of a real node (DeepServe §6, "fast scaling"): time from a
scale-out decision to the new TE serving, per stage, for three sources side
by side, and the client-visible TTFT of a request to a model at zero TEs.

    python tools/bench_scaling.py [--preset tiny,small] [--rounds 3] [--sizes 1,2,4] \\
        [--json PATH]

Sources (one node each, all four alive for the whole preset, always stopped):
  cold             [scaling] pool_size 0, no weight cache: a new TE process
                   (Python + torch imports) loading its weights from disk
  prewarmed        pool_size max(--sizes), no weight cache: a pre-warmed
                   process from the pool, loading from disk
  prewarmed_cache  the same pool, plus the node's shared-memory weight cache
  fork             the prewarmed pool, and a model the node does not have: its
                   files forked from a peer's weight server (this process,
                   cache/weight_fork.py, over loopback tcp) into /dev/shm, the
                   N TEs of one ScaleOut sharing one fork (its own stage); a
                   new path each time, so every measurement forks afresh. N
                   hosts forking at once (star, chain): tools/bench_fork.py

A measurement injects ScaleOut(model, count=N) into the node's supervisor
inbox (bypassing the autoscaler) and waits for N `scaled_out` events in the
health log; each carries total_s (decision -> listed in the cluster manager's
TE list, i.e. after its warm-up request) and its five stages (scaler_pre,
te_pre_load, te_load, te_post_load, scaler_post; messages/scaling.py). A
round's number for N TEs is the time until all N serve (the slowest TE's
total_s; its stages are the ones shown); the first TE's is kept too. The
TEs are then scaled in by hand. Before every measurement all three nodes
are settled (no TE, pools full and ready, weight cache filled), so one
node's pool refill never competes for the cores with another's measurement.

Scale-from-zero TTFT (N=1 per source): with the model at zero TEs, one
streamed /v1/completions request; the time to the first chunk with text
(the job executor holds the request, the autoscaler starts a TE:
demand_from_zero).

Rounds are interleaved (cold, prewarmed, prewarmed_cache, cold, ...) for
every N and for the TTFT; a table per preset gives medians with min-max, the
median of each stage, and cold / prewarmed_cache. Models: models/<preset>
if present, else tools/make_model.py --preset <preset> into a temporary
directory. The autoscaler's low-load scale-in is switched off (in_sustain_s,
in_cooldown_s huge) so that it never removes a TE mid-measurement; one it
removes anyway is tolerated.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import click
import httpx
import msgspec
import zmq

from deepserve.cache.weight_fork import WeightServer
from deepserve.config.models import ModelSpec, ScalingSection
from deepserve.ipc.sockets import PushSocket, free_port
from deepserve.messages.scaling import STAGES, ScaleIn, ScaleOut
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, SupervisorConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # tools/bench_stats.py
import bench_stats  # noqa: E402
SOURCES = ("cold", "prewarmed", "prewarmed_cache", "fork")
FORK = "fork"
MODEL = "m"
CONTROL = ("cluster-manager", "job-executor", "gateway")
TE_OPTIONS = {"max_num_batched_tokens": 256, "kv_cache_memory": 64 << 20}
NEVER_S = 1e7  # the autoscaler's in_sustain_s / in_cooldown_s: no low-load scale-in
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}


def median(values: list[float]) -> float | None:
    return bench_stats.percentile(values, 50)


# -- one node per source -------------------------------------------------------------------
class HealthTail:
    """The health log's events, read incrementally (whole lines only)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.events = path, 0, []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return self.events
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            if line.strip():
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))
        return self.events


class Subject:
    """A node serving MODEL with one source's [scaling] settings."""

    def __init__(self, source: str, model_dir: Path, log_dir: Path, pool_size: int,
                 cache_bytes: int, startup_timeout_s: float, peer: "Peer | None" = None,
                 max_restarts: int = SupervisorConfig().max_restarts):
        self.source, self.model_dir, self.peer = source, str(model_dir), peer
        self.pool_size = 0 if source == "cold" else pool_size
        cache = cache_bytes if source == "prewarmed_cache" else 0
        config = NodeConfig.build(
            port=free_port(), startup_timeout_s=startup_timeout_s, te_timeout_s=10,
            supervisor=SupervisorConfig(log_dir=str(log_dir), startup_grace_s=300,
                                        max_restarts=max_restarts),
            models=[ModelSpec(name=MODEL, path=self.model_dir, min_tes=0, max_tes=max(4, pool_size),
                              options=TE_OPTIONS)],
            scaling=ScalingSection(pool_size=self.pool_size, weight_cache_bytes=cache,
                                   queue_timeout_s=600.0, in_sustain_s=NEVER_S,
                                   in_cooldown_s=NEVER_S))
        self.node = Node(config)
        self.log_dir = log_dir
        self.health = HealthTail(self.node.log_dir / "health.jsonl")
        self.push: PushSocket | None = None

    def start(self, ctx: zmq.Context) -> None:
        self.node.start()
        self.push = PushSocket(ctx, self.node.run.hb, bind=False)

    def stop(self) -> None:
        if self.push is not None:
            self.push.close()
            self.push = None
        self.node.stop()

    # -- state -------------------------------------------------------------------------
    def events(self, since: int = 0, kind: str | None = None) -> list[dict]:
        return [e for e in self.health.poll()[since:] if kind is None or e["event"] == kind]

    def mark(self) -> int:
        return len(self.health.poll())

    def tes(self) -> list[str]:
        return [t for t in list(self.node.te_ids) if not t.startswith("pool")]

    def ready_pods(self) -> int:
        for _ in range(5):  # the supervisor thread may be changing it
            with contextlib.suppress(RuntimeError):
                return sum(dict(self.node.scaler.pods).values())
        return 0

    def is_cached(self) -> bool:
        return self.node.weights is not None and self.node.weights.lookup(self.model_dir) is not None

    def is_settled(self) -> bool:
        scaler = self.node.scaler
        return (not self.tes() and not scaler.starting and not scaler.retiring
                and self.ready_pods() >= self.pool_size
                and (self.source != "prewarmed_cache" or self.is_cached()))

    def state(self) -> str:
        return (f"TEs {self.tes()}, starting {list(self.node.scaler.starting)}, retiring "
                f"{list(self.node.scaler.retiring)}, ready pods {self.ready_pods()}/"
                f"{self.pool_size}, cached {self.is_cached()}")

    def check_alive(self) -> None:
        procs = self.node.procs  # not node.dead(): an entry being adopted has no Popen yet
        dead = [f"{n} (exit {procs[n].returncode})" for n in CONTROL
                if procs.get(n) is not None and procs[n].poll() is not None]
        if dead:
            raise RuntimeError(f"{self.source}: node process(es) died: {dead} (logs: "
                               f"{self.log_dir})")

    def send(self, msg) -> None:
        """An order as the node's own cluster manager gives it: in its head term."""
        self.push.put(msgspec.structs.replace(msg, term=self.node.config.term), timeout=2)


def wait_until(predicate, timeout_s: float, what: str, subjects=(), poll_s: float = 0.05):
    """predicate()'s first truthy value; TimeoutError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        for s in subjects:
            s.check_alive()
        if time.monotonic() > deadline:
            state = "; ".join(f"{s.source}: {s.state()}" for s in subjects)
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                               + (f" ({state})" if state else ""))
        time.sleep(poll_s)


def settle(subjects: list[Subject], timeout_s: float) -> None:
    wait_until(lambda: all(s.is_settled() for s in subjects), timeout_s,
               "every node to be idle with its pool ready", subjects, poll_s=0.2)


def _failures(s: Subject, since: int, te_ids) -> list[dict]:
    """Starts that failed for good (a crash alone may be followed by a restart)."""
    return [e for e in s.events(since) if e["event"] in ("scale_failed", "failed")
            and not e["component"].startswith("pool")
            and (te_ids is None or e["component"] in te_ids)]


def scale_in(s: Subject, te_ids: list[str], since: int, timeout_s: float,
             model: str = MODEL) -> None:
    """ScaleIn each TE; wait until all are gone (a scale-in we did not ask for counts)."""
    for te_id in te_ids:
        s.send(ScaleIn(te_id=te_id, model=model, reason="bench"))
    gone = lambda: {e["component"] for e in s.events(since, "scaled_in")}  # noqa: E731
    wait_until(lambda: set(te_ids) <= gone() and not set(te_ids) & set(s.tes()), timeout_s,
               f"{s.source}: scale-in of {te_ids}", [s])


def sample_of(events: list[dict]) -> dict:
    """N scaled_out events -> one measurement: all serving (the slowest), the first."""
    tes = [{"te_id": e["component"], "source": e["details"]["source"],
            "weights": e["details"].get("weights"), "total_s": e["details"]["total_s"],
            "stages": e["details"]["stages"]} for e in events]
    forks = [t["stages"].get("fork") for t in tes if t["stages"].get("fork") is not None]
    slowest = max(tes, key=lambda t: t["total_s"])
    return {"total_s": slowest["total_s"], "first_s": min(t["total_s"] for t in tes),
            "stages": slowest["stages"], "sources": sorted({t["source"] for t in tes}),
            "weights": sorted({t["weights"] or "" for t in tes}),
            "fork_s": max(forks) if forks else None, "tes": tes}


class Peer:
    """The fork source's peer: a weight server in this process sharing the
    model's directory under a new name for every measurement (a fresh fork)."""

    def __init__(self, ctx: zmq.Context, model_dir: Path):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.paths: dict[str, Path] = {}
        self.server = WeightServer(ctx, self.address, lambda: dict(self.paths))
        self.model_dir, self.count = model_dir, 0

    def order(self, count: int) -> ScaleOut:
        """A ScaleOut of a model the node does not have, from this peer."""
        self.count += 1
        path = f"/bench-peer/{self.count}/{self.model_dir.name}"
        self.paths[path] = self.model_dir
        return ScaleOut(model=f"{MODEL}-fork{self.count}", count=count, reason="bench",
                        path=path, options=TE_OPTIONS, sources=[self.address])

    def drop(self, node: Node, order: ScaleOut) -> None:
        """The node's forked copy goes (the next measurement forks afresh)."""
        self.paths.pop(order.path, None)
        node.models.drop_fork(order.path)

    def stop(self) -> None:
        self.server.stop()


def measure_scale_out(s: Subject, count: int, timeout_s: float) -> dict:
    since, load = s.mark(), os.getloadavg()[0]
    order = (s.peer.order(count) if s.peer is not None
             else ScaleOut(model=MODEL, count=count, reason="bench"))
    sent = time.monotonic()
    s.send(order)

    def outs():
        bad = _failures(s, since, None)
        if bad:
            raise RuntimeError(f"{s.source}: a TE failed to start: {bad}")
        events = [e for e in s.events(since, "scaled_out") if e["details"].get("reason") == "bench"]
        return events if len(events) >= count else None
    events = wait_until(outs, timeout_s, f"{s.source}: {count} TE(s) to serve", [s])[:count]
    observed = time.monotonic() - sent
    sample = {**sample_of(events), "observed_s": round(observed, 3), "load_avg": load}
    scale_in(s, [t["te_id"] for t in sample["tes"]], since, timeout_s, order.model)
    if s.peer is not None:
        s.peer.drop(s.node, order)
    return sample


def measure_ttft(s: Subject, url: str, timeout_s: float) -> dict:
    """Scale from zero: one streamed request to the model at zero TEs."""
    since, load = s.mark(), os.getloadavg()[0]
    ttft = None
    text = ""
    started = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10)) as client:
        with client.stream("POST", f"{url}/v1/completions", json=PROMPT) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{s.source}: scale-from-zero request: HTTP {r.status_code} "
                                   f"{r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                piece = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if piece and ttft is None:
                    ttft = time.monotonic() - started
                text += piece
    e2e = time.monotonic() - started
    if ttft is None:
        raise RuntimeError(f"{s.source}: scale-from-zero request streamed no text")

    def outs():
        return [e for e in s.events(since, "scaled_out")
                if e["details"].get("reason") == "demand_from_zero"] or None
    events = wait_until(outs, 60, f"{s.source}: the demand_from_zero scaled_out event", [s])
    sample = {"ttft_s": round(ttft, 4), "e2e_s": round(e2e, 4), "text": text,
              "load_avg": load, **sample_of(events)}
    scale_in(s, [t["te_id"] for t in sample["tes"]], since, timeout_s)
    return sample


# -- one preset --------------------------------------------------------------------------
def model_dir_for(preset: str, tmp: Path) -> Path:
    local = ROOT / "models" / preset
    if (local / "config.json").exists():
        return local
    out = tmp / f"model-{preset}"
    print(f"# generating the {preset} model in {out} ...", flush=True)
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(out),
                    "--preset", preset], check=True, stdout=subprocess.DEVNULL)
    return out


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def run_preset(preset: str, sizes: list[int], rounds: int, opts: dict, tmp: Path,
               results: list[dict]) -> None:
    """Measure one preset; its result is appended to results at once (kept if interrupted)."""
    model_dir = model_dir_for(preset, tmp)
    pool = max(sizes)
    result = {"preset": preset, "model": str(model_dir), "weight_bytes": weight_bytes(model_dir),
              "pool_size": pool, "rounds": rounds, "sizes": sizes, "scale_out": [], "ttft": [],
              "error": None}
    results.append(result)
    ctx = zmq.Context()
    subjects: list[Subject] = []
    peer = Peer(ctx, model_dir)
    try:
        for source in SOURCES:
            log_dir = Path(tempfile.mkdtemp(prefix=f"{preset}-{source}-", dir=opts["log_dir"]))
            s = Subject(source, model_dir, log_dir, pool, opts["cache_bytes"], opts["timeout"],
                        peer if source == FORK else None)
            subjects.append(s)
            t = time.monotonic()
            s.start(ctx)
            print(f"# {preset}: node {source} up in {time.monotonic() - t:.1f} s "
                  f"(run {s.node.run_id}, {s.node.url}, logs {log_dir})", flush=True)
        settle(subjects, opts["settle_timeout"])
        for r in range(rounds):
            for n in sizes:
                for s in subjects:
                    settle(subjects, opts["settle_timeout"])
                    sample = measure_scale_out(s, n, opts["timeout"])
                    result["scale_out"].append({"source": s.source, "n": n, "round": r, **sample})
                    print(f"  round {r} {s.source:<16} N={n}: all serving {sample['total_s']:.2f} s"
                          f" (first {sample['first_s']:.2f}, sources {sample['sources']}, load "
                          f"{sample['load_avg']:.1f})", flush=True)
            if opts["ttft"]:
                for s in subjects:
                    if s.source == FORK:
                        continue  # its model is one it does not have: no scale from zero
                    settle(subjects, opts["settle_timeout"])
                    sample = measure_ttft(s, s.node.url, opts["timeout"])
                    result["ttft"].append({"source": s.source, "round": r, **sample})
                    print(f"  round {r} {s.source:<16} scale-from-zero TTFT "
                          f"{sample['ttft_s']:.2f} s (scale-out {sample['total_s']:.2f} s, "
                          f"sources {sample['sources']})", flush=True)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - reported, partial results kept
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"ERROR ({preset}): {result['error']}", file=sys.stderr, flush=True)
        traceback.print_exc()
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        for s in subjects:
            try:
                s.stop()
            except Exception as e:  # noqa: BLE001 - stop the others regardless
                print(f"ERROR stopping {s.source}: {e}", file=sys.stderr)
        peer.stop()
        ctx.term()
        result["summary"] = summarize(result, sizes)


# -- the numbers and the table -------------------------------------------------------------
def _stat(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(result: dict, sizes: list[int]) -> dict:
    rows = []
    for n in sizes:
        for source in SOURCES:
            samples = [x for x in result["scale_out"] if x["source"] == source and x["n"] == n]
            rows.append({
                "source": source, "n": n,
                "total_s": _stat([x["total_s"] for x in samples]),
                "first_s": _stat([x["first_s"] for x in samples]),
                "stages": {k: median([x["stages"][k] for x in samples if k in x["stages"]])
                           for k in STAGES},
                "missing_stages": sum(1 for x in samples if set(STAGES) - set(x["stages"])),
                "samples": len(samples),
                "fork_s": _stat([x["fork_s"] for x in samples if x.get("fork_s") is not None]),
                "weights_seen": sorted({y for x in samples for y in x.get("weights", [])}),
                "sources_seen": sorted({y for x in samples for y in x["sources"]})})
    ttft = {}
    for source in SOURCES[:-1]:  # not fork (run_preset)
        samples = [x for x in result["ttft"] if x["source"] == source]
        ttft[source] = {"ttft_s": _stat([x["ttft_s"] for x in samples]),
                        "scale_out_s": _stat([x["total_s"] for x in samples]),
                        "sources_seen": sorted({y for x in samples for y in x["sources"]})}
    ratios = {}
    for n in sizes:
        by = {r["source"]: r["total_s"] for r in rows if r["n"] == n}
        ratios[f"n{n}"] = _ratio(by["cold"], by["prewarmed_cache"])
    ratios["ttft"] = _ratio(ttft["cold"]["ttft_s"], ttft["prewarmed_cache"]["ttft_s"])
    forks = {r["n"]: r["total_s"] for r in rows if r["source"] == FORK}
    fork_ratios = {f"n{n}": _ratio(forks[n], forks[sizes[0]]) for n in sizes[1:]}
    return {"rows": rows, "ttft": ttft, "cold_over_prewarmed_cache": ratios,
            "fork_over_fork_n1": fork_ratios}


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or not b["median"]:
        return None
    return a["median"] / b["median"]


def _range(stat: dict | None) -> str:
    if stat is None:
        return "-"
    return f"{stat['median']:.2f} ({stat['min']:.2f}-{stat['max']:.2f})"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


HEADER = ("source           N | all serving s (min-max) | first s | "
          + " | ".join(STAGES) + " | sources seen")


def table(result: dict) -> str:
    summary = result["summary"]
    mb = result["weight_bytes"] / 1e6
    lines = [f"## preset {result['preset']}: {result['model']} ({mb:.1f} MB of weights), "
             f"pool {result['pool_size']}, {result['rounds']} round(s); medians (min-max) of "
             f"decision -> in the TE list, seconds", HEADER]
    last_n = None
    for row in summary["rows"]:
        if row["n"] != last_n and last_n is not None:
            lines.append("")
        last_n = row["n"]
        stages = " | ".join(f"{_s(row['stages'][k]):>{len(k)}}" for k in STAGES)
        pods = "prewarmed" if row["source"] == FORK else row["source"]  # fork: from the pool
        flag = "" if row["sources_seen"] in ([], [pods]) else "  <- not the source asked"
        if row["missing_stages"]:
            flag += f"  ({row['missing_stages']}/{row['samples']} without the TE's stages)"
        if row["source"] == FORK:
            flag += (f"  (fork stage {_range(row['fork_s'])})" if row["fork_s"] and
                     row["weights_seen"] == ["fork"] else "  <- weights not forked")
        lines.append(f"{row['source']:<16} {row['n']:>1} | {_range(row['total_s']):>23} | "
                     f"{_s(row['first_s'] and row['first_s']['median']):>7} | {stages} | "
                     f"{','.join(row['sources_seen']) or '-'}{flag}")
    if any(v["ttft_s"] for v in summary["ttft"].values()):
        lines += ["", "scale-from-zero (N=1)    | client TTFT s (min-max) | its scale-out s "
                      "(min-max) | sources seen"]
        for source, v in summary["ttft"].items():
            lines.append(f"{source:<24} | {_range(v['ttft_s']):>23} | "
                         f"{_range(v['scale_out_s']):>25} | {','.join(v['sources_seen']) or '-'}")
        lines.append("fork                     | not measured: the node has no model to scale "
                     "from zero")
    ratios = ", ".join(f"{k.replace('n', 'N=') if k != 'ttft' else 'TTFT'} "
                       f"{'-' if v is None else f'x{v:.2f}'}"
                       for k, v in summary["cold_over_prewarmed_cache"].items())
    forks = ", ".join(f"N={k[1:]} x{v:.2f}" if v is not None else f"N={k[1:]} -"
                      for k, v in summary["fork_over_fork_n1"].items())
    lines += ["", f"cold / prewarmed_cache (medians): {ratios}",
              f"fork N / fork N={result['sizes'][0]} (medians): {forks}"]
    if result["error"]:
        lines.append(f"INCOMPLETE: {result['error']}")
    return "\n".join(lines)


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--preset", default="tiny,small", help="model presets, in order (comma-separated)")
@click.option("--rounds", default=3, help="interleaved rounds per source and N")
@click.option("--sizes", default="1,2,4", help="TEs started at once (one ScaleOut each)")
@click.option("--no-ttft", is_flag=True, help="skip the client scale-from-zero TTFT")
@click.option("--timeout", default=300.0, help="seconds for one scale-out or scale-in")
@click.option("--settle-timeout", default=300.0, help="seconds for the nodes to be idle with "
              "full pools before a measurement")
@click.option("--cache-bytes", default=4 << 30, help="the prewarmed_cache node's weight cache")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="the nodes' logs (default: a temporary directory, kept only on an error)")
def main(preset, rounds, sizes, no_ttft, timeout, settle_timeout, cache_bytes, json_path, log_dir):
    signal.signal(signal.SIGTERM, _sigterm)
    size_list = [int(x) for x in sizes.split(",")]
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="bench_scaling-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    opts = {"timeout": timeout, "settle_timeout": settle_timeout, "cache_bytes": cache_bytes,
            "ttft": not no_ttft, "log_dir": logs}
    started = time.monotonic()
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; rounds {rounds}, N "
          f"{size_list}; sources {', '.join(SOURCES)}", flush=True)
    results: list[dict] = []
    printed = 0
    try:
        with tempfile.TemporaryDirectory(prefix="bench_scaling-") as tmp:
            for p in preset.split(","):
                run_preset(p, size_list, rounds, opts, Path(tmp), results)
                print("\n" + table(results[-1]) + "\n", flush=True)
                printed += 1
    except KeyboardInterrupt:
        print("interrupted: the nodes were stopped; partial results follow", file=sys.stderr)
    finally:
        for result in results[printed:]:
            if "summary" in result:
                print("\n" + table(result) + "\n", flush=True)
        failed = [r for r in results if r["error"]] or len(results) < len(preset.split(","))
        if failed:
            print(f"# node logs kept in {logs}", file=sys.stderr)
        elif not log_dir:
            shutil.rmtree(logs, ignore_errors=True)
        if json_path:
            Path(json_path).write_text(json.dumps({"rounds": rounds, "sizes": size_list,
                                                   "presets": results}, indent=1))
        print(f"# {len(results)} preset(s) in {time.monotonic() - started:.0f} s", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
