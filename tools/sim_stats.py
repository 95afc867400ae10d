"""What tools/sim_cluster.py counts during a run, its summary and its table.

Time in the summary: *_us are wall-clock microseconds of the real control
code (per decision, push or report); *_s of jobs (JCT, TTFT) are simulated.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from time import perf_counter

from deepserve.cache.block_hash import prompt_block_hashes

SAMPLE_EVERY = 16  # every 16th decision's prompt is kept for the match / hash probe
MAX_SAMPLES = 256


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _us(seconds: float, n: int) -> float:
    return 1e6 * seconds / max(1, n)


@dataclass
class Stats:
    num_decisions: int = 0  # jobs routed (PD + one or two Router.decide)
    num_router_calls: int = 0
    scan_s: float = 0.0  # the model's TE types present (Router.te_types)
    pd_s: float = 0.0  # PDPolicy.decide
    router_s: float = 0.0  # Router.decide
    cpu_s: float = 0.0  # thread CPU time of the three (robust when cores are shared)
    layouts: Counter = field(default_factory=Counter)
    rules: Counter = field(default_factory=Counter)  # of the first Router.decide per job
    num_routed_blocks: int = 0
    num_matched_blocks: int = 0  # the router's match (its index) for the first TE
    num_prompt_blocks: int = 0
    num_cached_blocks: int = 0  # what the prefilling TE's cache held
    jct: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    finished: Counter = field(default_factory=Counter)  # request id -> times finished
    num_later_turns: int = 0
    num_same_te: int = 0  # later turns prefilled on the TE of the turn before
    chance: float = 0.0  # expected num_same_te of a uniformly random choice
    push_bytes: list[int] = field(default_factory=list)
    push_codec_s: list[float] = field(default_factory=list)  # msgpack encode + decode
    update_s: list[float] = field(default_factory=list)  # Router.update_tes
    tes_listed: list[int] = field(default_factory=list)  # TE-list length per push
    on_report_s: float = 0.0
    num_reports: int = 0
    num_lost: int = 0
    num_scale_out: int = 0
    num_scale_in: int = 0
    samples: list = field(default_factory=list)  # (model, te type, prompt)
    num_events: int = 0
    wall_s: float = 0.0

    def on_decision(self, scan_s: float, pd_s: float, router_s: float, cpu_s: float,
                    layout: str, first, job) -> None:
        self.num_decisions += 1
        self.cpu_s += cpu_s
        self.num_router_calls += 2 if layout == "disaggregated" else 1
        self.scan_s, self.pd_s, self.router_s = (self.scan_s + scan_s, self.pd_s + pd_s,
                                                 self.router_s + router_s)
        self.layouts[layout] += 1
        self.rules[first.rule] += 1
        self.num_routed_blocks += len(job.hashes)
        self.num_matched_blocks += first.matched_blocks
        if self.num_decisions % SAMPLE_EVERY == 0 and len(self.samples) < MAX_SAMPLES:
            te_type = "prefill" if layout == "disaggregated" else "colocated"
            self.samples.append((job.model, te_type, job.prompt))

    def on_locality(self, session, te_id: str, num_candidates: int) -> None:
        """A session's turn was prefilled on te_id, one of num_candidates."""
        if session.last_te is not None:
            self.num_later_turns += 1
            self.num_same_te += session.last_te == te_id
            self.chance += 1.0 / max(1, num_candidates)
        session.last_te = te_id

    def on_finish(self, job) -> None:
        self.finished[job.request_id] += 1
        self.jct.append(job.finished_at - job.arrived)
        self.ttft.append(job.first_token_at - job.arrived)
        self.num_prompt_blocks += len(job.hashes)
        self.num_cached_blocks += job.num_cached_blocks

    def on_push(self, num_bytes: int, codec_s: float, num_tes: int) -> None:
        self.push_bytes.append(num_bytes)
        self.push_codec_s.append(codec_s)
        self.tes_listed.append(num_tes)

    def summary(self, sim, probe: tuple[float, float]) -> dict:
        routing_s = self.scan_s + self.pd_s + self.router_s
        index = sim.router.index
        return {
            "num_tes": sim.cfg.num_tes, "num_requests": sim.cfg.num_requests,
            "num_finished": sum(self.finished.values()), "num_lost": self.num_lost,
            "num_decisions": self.num_decisions, "num_router_calls": self.num_router_calls,
            "decisions_per_s": self.num_decisions / routing_s if routing_s else None,
            "decisions_per_cpu_s": self.num_decisions / self.cpu_s if self.cpu_s else None,
            "decision_us": _us(routing_s, self.num_decisions),
            "scan_us": _us(self.scan_s, self.num_decisions),
            "pd_us": _us(self.pd_s, self.num_decisions),
            "router_us": _us(self.router_s, self.num_decisions),
            "match_us": probe[0], "hash_us": probe[1],
            "hit_rate": self.num_cached_blocks / max(1, self.num_prompt_blocks),
            "matched_rate": self.num_matched_blocks / max(1, self.num_routed_blocks),
            "later_turn_same_te": self.num_same_te / max(1, self.num_later_turns),
            "later_turn_chance": self.chance / max(1, self.num_later_turns),
            "jct_p50_s": quantile(self.jct, 0.5), "jct_p90_s": quantile(self.jct, 0.9),
            "ttft_p50_s": quantile(self.ttft, 0.5),
            "num_pushes": len(self.push_bytes),
            "push_bytes": statistics.median(self.push_bytes),
            "push_codec_us": 1e6 * statistics.median(self.push_codec_s),
            "update_tes_us": 1e6 * statistics.median(self.update_s),
            "num_reports": self.num_reports,
            "on_report_us": _us(self.on_report_s, self.num_reports),
            "index_hashes": sum(index.num_hashes(t) for t in sim.router.tes),
            "tes_listed": {"start": self.tes_listed[0], "min": min(self.tes_listed),
                           "max": max(self.tes_listed), "end": self.tes_listed[-1]},
            "num_scale_out": self.num_scale_out, "num_scale_in": self.num_scale_in,
            "layouts": dict(self.layouts), "rules": dict(self.rules),
            "sim_time_s": sim.now, "sim_wall_s": self.wall_s, "num_events": self.num_events,
            "events_per_s": self.num_events / self.wall_s if self.wall_s else None,
        }


def probe(router, samples: list) -> tuple[float, float]:
    """(us of GlobalPromptIndex.best_matches over the candidates, as the router
    calls it, us hashing the prompt) per sampled decision, timed again on the
    router's index as the run left it."""
    match_s = hash_s = 0.0
    for model, te_type, prompt in samples:
        ids = [te.te_id for te in router.candidates(te_type, model)]
        t0 = perf_counter()
        hashes = prompt_block_hashes(prompt, router.block_size)
        t1 = perf_counter()
        router.index.best_matches(ids, hashes)
        match_s += perf_counter() - t1
        hash_s += t1 - t0
    n = max(1, len(samples))
    return 1e6 * match_s / n, 1e6 * hash_s / n


COLUMNS = [  # (header, format of a summary row)
    ("TEs", lambda r: f"{r['num_tes']}"),
    ("dec/s", lambda r: f"{r['decisions_per_s']:.0f}"),
    ("dec/cpu-s", lambda r: f"{r['decisions_per_cpu_s']:.0f}"),
    ("us/dec", lambda r: f"{r['decision_us']:.0f}"),
    ("scan", lambda r: f"{r['scan_us']:.0f}"),
    ("pd", lambda r: f"{r['pd_us']:.0f}"),
    ("router", lambda r: f"{r['router_us']:.0f}"),
    ("match", lambda r: f"{r['match_us']:.0f}"),
    ("hash", lambda r: f"{r['hash_us']:.0f}"),
    ("hit", lambda r: f"{r['hit_rate']:.2f}"),
    ("same/chance", lambda r: f"{r['later_turn_same_te']:.2f}/{r['later_turn_chance']:.3f}"),
    ("JCT p50/p90 s", lambda r: f"{r['jct_p50_s']:.2f}/{r['jct_p90_s']:.2f}"),
    ("push KiB", lambda r: f"{r['push_bytes'] / 1024:.1f}"),
    ("push us", lambda r: f"{r['push_codec_us']:.0f}"),
    ("update us", lambda r: f"{r['update_tes_us']:.0f}"),
    ("report us", lambda r: f"{r['on_report_us']:.1f}"),
    ("index hashes", lambda r: f"{r['index_hashes']}"),
    ("TEs min-max", lambda r: f"{r['tes_listed']['min']}-{r['tes_listed']['max']}"),
    ("events/s", lambda r: f"{r['events_per_s']:.0f}"),
]


def table(rows: list[dict], header: bool = True) -> str:
    """One line per run; us columns are per decision unless named otherwise."""
    lines = [" | ".join(h for h, _ in COLUMNS)] if header else []
    lines += [" | ".join(fmt(r) for _, fmt in COLUMNS) for r in rows]
    return "\n".join(lines)
