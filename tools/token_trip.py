"""One token's trip from the worker's forward to the client, hop by hop, and
the CPU every process of the node spends per token.

Starts a one-TE node as tools/bench_serving_vllm.py does (same generated
config) with $DEEPSERVE_TIMELINE set, so that every process of it records its
spans (src/deepserve/ipc/timeline.py), then at each --concurrency runs that
many streamed completions at once (--input-len random token ids,
--output-len tokens with ignore_eos) from a client in this process, which
notes when each event arrives. After the node stops, the spans are joined
per token (the tokenizer's reply_item names the step a token came from, the
gateway's sse span the token itself) and the trip of every decode token is
cut into hops, median and p90 over the tokens:

    worker     forward · sample (logits, sampling) · step_done (-> StepDone's send begins)
    -> master  wake (-> StepDone received) · collect (-> StepTokens sent)
    -> tok     wake (-> StepTokens handled) · detok+reply (-> this request's delta sent)
    -> gateway wake (-> the HTTP writer has the delta: zmq, routing, asyncio) ·
               sse (-> its event written)
    -> client  wire (-> the client has the event)

and the total, forward end to client. Per process: CPU ms per output token
while the level ran, and CPU % while the node idled before it.

    python tools/token_trip.py --model models/smollm2-135m-instruct --concurrency 1,8
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import click
import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_runs  # noqa: E402
import bench_serving_vllm as serving  # noqa: E402

HOPS = ("worker forward", "worker sample", "worker step_done", "master wake", "master collect",
        "tokenizer wake", "tokenizer detok+reply", "gateway wake", "gateway sse", "client wire")


async def _one(http: httpx.AsyncClient, url: str, name: str, prompt: list[int], n: int,
               arrivals: dict) -> None:
    """Stream one completion; arrivals[(its request id, event count)] = when."""
    body = {"model": name, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                rid = f"{chunk['id']}-{choice['index']}"
                events += 1
                arrivals[(rid, events)] = now


async def _level(url: str, name: str, prompts: list[list[int]], n: int) -> dict:
    arrivals: dict = {}
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*[_one(http, url, name, p, n, arrivals) for p in prompts])
    return arrivals


def _node_processes(root: psutil.Process) -> dict[int, str]:
    """pid -> role: the node's processes by their module; a TE's processes
    are named later, by their timeline files (written when the node stops)."""
    roles = {}
    for proc in [root] + root.children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "python" not in cmd:
            continue
        words = [w for w in cmd.split() if w.startswith("deepserve.")]
        roles[proc.pid] = words[0].rsplit(".", 1)[-1] if words else "te-process"
    return roles


def _cpu(pids) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def trip(spans: dict[str, list], arrivals: dict) -> dict[str, list[float]]:
    """hop -> its durations (s), one per decode token that made the whole trip."""
    by_role = defaultdict(list)
    for component, items in spans.items():
        by_role[component.rsplit("-", 1)[-1]].extend(items)
    step = {r: {(p, s): (a, b) for p, s, a, b, *_ in by_role[r]} for r in
            ("worker0", "master", "tokenizer")}
    replies = {k: (s, a, b) for p, s, a, b, _, k in by_role["tokenizer"] if p == "reply_item"}
    sse = defaultdict(list)  # request -> [(tokens, got, written, chunks)]
    for p, _, a, b, n_chunks, k in by_role["gateway"]:
        if p == "sse":
            rid, num = k.rsplit("#", 1)
            sse[rid].append((int(num), a, b, n_chunks))
    client_at = {}
    for rid, items in sse.items():  # the client's event count -> the gateway span it closed
        events = 0
        for num, a, b, n_chunks in sorted(items):
            events += n_chunks
            if n_chunks and (rid, events) in arrivals:
                client_at[f"{rid}#{num}"] = arrivals[(rid, events)]
    written = {f"{rid}#{num}": (a, b) for rid, items in sse.items() for num, a, b, _ in items}
    hops = defaultdict(list)
    w, m, t = step["worker0"], step["master"], step["tokenizer"]
    for key, (s, _, r1) in replies.items():
        if int(key.rsplit("#", 1)[1]) < 2 or key not in written or key not in client_at:
            continue  # the first token comes out of a prefill
        try:
            fwd, smp, done = w[("forward", s)], w[("sample", s)], w[("step_done", s)]
            col, detok = m[("collect", s)], t[("detokenize", s)]
        except KeyError:
            continue
        got, out = written[key]
        marks = [fwd[0], fwd[1], smp[1], done[0], col[0], col[1], detok[0], r1, got, out,
                 client_at[key]]
        for hop, a, b in zip(HOPS, marks, marks[1:]):
            hops[hop].append(b - a)
        hops["total: forward end -> client"].append(marks[-1] - fwd[1])
    return hops


def print_trip(c: int, hops: dict[str, list[float]]) -> None:
    print(f"\nc = {c}: {len(hops.get('client wire', []))} decode tokens")
    print("hop | median ms | p90 ms")
    for hop, values in hops.items():
        values = sorted(values)
        print(f"{hop} | {statistics.median(values) * 1e3:.2f} | "
              f"{values[int(0.9 * (len(values) - 1))] * 1e3:.2f}")


@click.command()
@click.option("--model", type=click.Path(path_type=Path),
              default=ROOT / "models" / "smollm2-135m-instruct")
@click.option("--dtype", default="bfloat16")
@click.option("--concurrency", default="1,8")
@click.option("--input-len", default=512)
@click.option("--output-len", default=128)
@click.option("--budget", default=2048, help="max_num_batched_tokens")
@click.option("--port", default=8131)
def main(model, dtype, concurrency, input_len, output_len, budget, port):
    from deepserve.ipc.timeline import ENV, read_spans
    from deepserve.model.config import load_model_config

    model = model.resolve()
    levels = [int(c) for c in concurrency.split(",")]
    out_dir = Path(tempfile.mkdtemp(prefix="token-trip-"))
    folder = out_dir / "timeline"
    os.environ[ENV] = str(folder)  # the node's processes inherit it
    vocab = load_model_config(model, dtype).vocab_size
    prompts = bench_runs.benchmark_prompts(vocab, levels, input_len)
    srv = serving.start_servers(["gateway"], "", model, model.name, port, dtype, dtype, budget,
                                levels, input_len, output_len, 0, out_dir)["gateway"]
    os.environ.pop(ENV)
    root = psutil.Process(srv["proc"].pid)
    cpu_rows, results = [], {}
    try:
        roles = _node_processes(root)
        for c in levels:
            idle0 = _cpu(roles)
            time.sleep(3.0)
            idle = {p: (v - idle0.get(p, v)) / 3.0 for p, v in _cpu(roles).items()}
            before, client0 = _cpu(roles), time.process_time()
            results[c] = asyncio.run(_level(srv["url"], model.name, prompts[c], output_len))
            used = {p: v - before.get(p, v) for p, v in _cpu(roles).items()}
            cpu_rows.append((c, idle, used, time.process_time() - client0, c * output_len))
    finally:
        serving.stop(srv["proc"])
    spans = read_spans(folder)
    for path in folder.glob("*.jsonl"):
        component, pid = path.stem.rsplit("-", 1)
        if int(pid) in roles:
            roles[int(pid)] = component.rsplit("-", 1)[-1]
    for c in levels:
        print_trip(c, trip(spans, results[c]))
    print("\nCPU per process: ms per output token while the level ran | % of a core idle")
    print(" | ".join(["process", *[f"c={c} ms/token | idle %" for c, *_ in cpu_rows]]))
    for pid, role in sorted(roles.items(), key=lambda kv: kv[1]):
        print(" | ".join([f"{role} ({pid})", *[
            f"{used.get(pid, 0) * 1e3 / tokens:.2f} | {idle.get(pid, 0) * 100:.1f}"
            for c, idle, used, _, tokens in cpu_rows]]))
    print(" | ".join(["client (this process)", *[f"{client * 1e3 / tokens:.2f} | -"
                                                 for c, _, _, client, tokens in cpu_rows]]))
    print(f"\nspans and logs in {out_dir}")


if __name__ == "__main__":
    main()
