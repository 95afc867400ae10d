"""The step timeline of one busy TE, from the spans its processes wrote.

tools/profile_step.py --engine runs a TE of processes with
$DEEPSERVE_TIMELINE set (src/deepserve/ipc/timeline.py: every process
writes its spans on close) and hands the folder here. For the decode steps
of a batch of B (the worker's forward ran exactly B tokens) this gives the
median wall time of each part of a step:

    master     schedule (build step N+1) · ring_write (encode + put)
    worker     ring_wait (idle: no step to run) · ring_read (get + decode)
               prepare (inputs, metadata) · forward · sample · step_done (send)
    master     transit (StepDone sent -> received) · collect (sampled -> StepTokens out)
    tokenizer  detokenize · reply (RequestDelta to the client)

and the step period (worker: one forward start to the next), which is what
a decode token costs each sequence. `forward + sample + prepare` is the
model-only step; period / that is the engine's overhead factor.
"""

from __future__ import annotations

import statistics
from pathlib import Path

PARTS = (("master", "schedule"), ("master", "ring_write"), ("worker", "ring_wait"),
         ("worker", "ring_read"), ("worker", "prepare"), ("worker", "forward"),
         ("worker", "sample"), ("worker", "step_done"), ("master", "transit"),
         ("master", "collect"), ("tokenizer", "detokenize"), ("tokenizer", "reply"))


def _by_step(spans, part: str) -> dict[int, tuple[float, float, int]]:
    return {s: (a, b, n) for p, s, a, b, n, *_ in spans if p == part}


def analyse(spans: dict[str, list], batch: int) -> dict:
    """spans: read_spans() of one run (one TE: components *-master, *-worker0,
    *-tokenizer). Returns per-part medians (s), the step period, the steps used."""
    role = {c.rsplit("-", 1)[-1]: v for c, v in spans.items()}
    master, worker, tok = role["master"], role["worker0"], role.get("tokenizer", [])
    fwd = _by_step(worker, "forward")
    steps = sorted(s for s, (_, _, n) in fwd.items() if n == batch)
    if len(steps) > 4:
        steps = steps[1:-1]  # the first decode step and the last (the batch ends) are ragged
    table = {("worker", p): _by_step(worker, p) for p in
             ("ring_wait", "ring_read", "prepare", "forward", "sample", "step_done")}
    table.update({("master", p): _by_step(master, p) for p in ("schedule", "ring_write",
                                                                "collect")})
    table.update({("tokenizer", p): _by_step(tok, p) for p in ("detokenize", "reply")})
    done, collect = table[("worker", "step_done")], table[("master", "collect")]
    table[("master", "transit")] = {s: (done[s][0], collect[s][0], 0)
                                    for s in steps if s in done and s in collect}
    medians = {}
    for key in PARTS:
        values = [table[key][s][1] - table[key][s][0] for s in steps if s in table[key]]
        medians[key] = statistics.median(values) if values else None
    starts = [fwd[s][0] for s in steps]
    periods = [b - a for a, b, s0, s1 in zip(starts, starts[1:], steps, steps[1:])
               if s1 == s0 + 1]
    model_only = [sum(table[("worker", p)][s][1] - table[("worker", p)][s][0]
                      for p in ("prepare", "forward", "sample")) for s in steps]
    return {"batch": batch, "steps": len(steps),
            "parts": {f"{proc}/{part}": v for (proc, part), v in medians.items()},
            "period_s": statistics.median(periods) if periods else None,
            "model_only_s": statistics.median(model_only) if model_only else None,
            "example": _example(table, steps)}


def _example(table, steps: list[int]) -> list[tuple[str, str, int, float, float]]:
    """Three consecutive decode steps from the middle: (process, part, step, start, end)."""
    if len(steps) < 3:
        return []
    mid = steps[len(steps) // 2 - 1: len(steps) // 2 + 2]
    return [(proc, part, s, *table[(proc, part)][s][:2])
            for (proc, part) in PARTS for s in mid if s in table[(proc, part)]]


def print_table(results: list[dict], label: str = "") -> None:
    cols = [f"B={r['batch']}" for r in results]
    print(f"\nstep timeline {label}(median ms over decode steps; "
          + ", ".join(f"B={r['batch']}: {r['steps']} steps" for r in results) + ")")
    print(" | ".join(["process", "part", *cols]))
    for key in PARTS:
        name = "/".join(key)
        cells = [f"{r['parts'][name] * 1e3:.2f}" if r["parts"][name] is not None else "-"
                 for r in results]
        print(" | ".join([*key, *cells]))
    for name, field in (("model-only (prepare+forward+sample)", "model_only_s"),
                        ("step period (forward start to next)", "period_s")):
        print(" | ".join(["worker", name, *[f"{r[field] * 1e3:.2f}" if r[field] else "-"
                                            for r in results]]))
    if all("worker_rss" in r for r in results):
        print(" | ".join(["worker", "RSS / (weights + KV pool)", *[
            f"{r['worker_rss'] / 2**30:.2f} / ({r['weights_bytes'] / 2**30:.2f} + "
            f"{r['kv_bytes'] / 2**30:.2f}) GiB = "
            f"{r['worker_rss'] / (r['weights_bytes'] + r['kv_bytes']):.2f}" for r in results]]))
    print(" | ".join(["", "period / model-only", *[
        f"{r['period_s'] / r['model_only_s']:.3f}" if r["period_s"] and r["model_only_s"]
        else "-" for r in results]]))


def plot(results: list[dict], path: Path, title: str) -> None:
    """One panel per batch size: three decode steps as bars on process lanes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip([p for _, p in PARTS], plt.get_cmap("tab20").colors))
    lanes = ["tokenizer", "master", "worker"]
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.4 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        ex = r["example"]
        if not ex:
            continue
        t0 = min(a for _, _, _, a, _ in ex)
        for proc, part, _, a, b in ex:
            ax.barh(lanes.index(proc), (b - a) * 1e3, left=(a - t0) * 1e3, height=0.6,
                    color=colors[part], label=part, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_title(f"batch {r['batch']}: period {r['period_s'] * 1e3:.1f} ms, model-only "
                     f"{r['model_only_s'] * 1e3:.1f} ms", fontsize=9)
        ax.set_xlabel("ms")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
