"""The numbers of a tools/bench_serve.py run: percentiles, throughput, cache
hit rate, and the table it prints. Pure functions over RequestResult-like
objects (ok, error, ttft_s, tpot_s, itl_s, e2e_s, prompt / cached /
completion tokens, has_usage)."""

from __future__ import annotations

from collections import Counter


def percentile(values: list[float], q: float) -> float | None:
    """q in [0, 100]; linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values: list[float]) -> dict:
    out = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    out["mean"] = sum(values) / len(values) if values else None
    return {k: None if v is None else v * 1000 for k, v in out.items()}


def summarize(results: list[RequestResult], duration_s: float, num_sessions_started: int = 0,
              num_sessions_done: int = 0) -> dict:
    ok = [r for r in results if r.ok]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    errors = Counter((r.error or "")[:200] for r in results if not r.ok)
    return {
        "duration_s": duration_s, "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "num_sessions_started": num_sessions_started, "num_sessions_done": num_sessions_done,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": completion / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
        "cache_hit_rate": cached / prompt if prompt else None,
        "num_without_usage": sum(1 for r in ok if not r.has_usage),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "errors": dict(errors.most_common(5)),
    }


def format_table(s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}"
    hit = "-" if s["cache_hit_rate"] is None else f"{100 * s['cache_hit_rate']:.1f}%"
    lines = [f"requests ok / failed   {s['num_ok']} / {s['num_failed']}   "
             f"(sessions done {s['num_sessions_done']} / {s['num_sessions_started']})",
             f"duration               {s['duration_s']:.1f} s",
             f"throughput             {s['request_throughput']:.2f} req/s   "
             f"{s['output_throughput']:.1f} output tok/s",
             f"tokens                 prompt {s['prompt_tokens']}  cached {s['cached_tokens']}  "
             f"completion {s['completion_tokens']}",
             f"prefix-cache hit rate  {hit}",
             f"{'(ms)':<22} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}"]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "inter-token"),
                       ("e2e_ms", "end-to-end")):
        d = s[key]
        cells = " ".join(f"{ms(d[k]):>9}" for k in ("p50", "p90", "p99", "mean"))
        lines.append(f"{label:<22} {cells}")
    if s["num_without_usage"]:
        lines.append(f"{s['num_without_usage']} ok request(s) had no usage chunk (tokens = chunks)")
    lines += [f"error x{n}: {e}" for e, n in s["errors"].items()]
    return "\n".join(lines)
