"""Cluster simulator: 1,000+ simulated TEs on simulated time, driving the real
job-executor routing, PD policy, cluster-manager scaling loop and autoscaler.

    python tools/sim_cluster.py [--tes 1024 | --te-counts 64,256,1024,4096]
        [--models 4] [--mix 2:1:1] [--requests 4000] [--load 0.4] [--policy combined]
        [--pd-mode heatmap] [--profile PROFILE.json] [--burst START:END:FACTOR]
        [--seed 0] [--json OUT.json]

    sessions (Poisson; multi-turn, shared prefixes)      sim_model.Workload
        │ a turn's prompt ids
        ▼
    JE: TE types of the model ─> PDPolicy.decide ─> Router.decide (x2 if PD)  real, timed
        ▲ update_tes(decoded TEList)      ▲ on_report(TEReport)   │ task
    CM: TEList ─msgpack─> JE              │                       ▼
        ScalingControl + Autoscaler <─────┴──── SimTE x N  (queue + server + block LRU)
        │ ScaleOut / ScaleIn                                 sim_model.SimTE
        ▼
    simulated supervisor: a TE is listed start_delay_s after its ScaleOut

Event heap, no sleeping: session arrivals, TE action ends, prefill -> decode
hand-offs (kv_transfer_s_per_token), TE reports every 0.5 s (only TEs with
news, and draining ones), a CM step every --tick-s (demand, decide, re-publish
the TE list each second). A TE scaled out takes the type that keeps its
model's --mix; no model has an SLO, so the autoscaler scales on queueing and
low load. Decisions/s count only the timed routing calls (one job: the
model's TE types + PD + hashing the prompt once + one or two Router.decide)
on one core; match (the index's best_matches over the candidates) and hash us
are re-timed after the run on sampled prompts. The process pins itself to one CPU.
--requests is per run: a larger cluster sees fewer per TE (colder caches).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import os
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter, thread_time

import click

from deepserve.control.cm.autoscaler import ModelPolicy
from deepserve.control.je.model_book import ModelBook
from deepserve.control.je.routing.pd_policy import PDPolicy
from deepserve.control.je.routing.prompt_index import GlobalPromptIndex
from deepserve.control.je.routing.router import NoTEAvailable, PromptHashes, Router
from deepserve.messages.control import TEInfo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # tools/sim_model.py, sim_cm.py, sim_stats.py
from sim_cm import TYPES, SimClusterManager  # noqa: E402
from sim_model import Job, Profile, SimTE, Workload  # noqa: E402
from sim_stats import Stats, probe, table  # noqa: E402

REPORT_INTERVAL_S = 0.5  # engine/te/master.py's report_interval_s default
IDLE_STOP_S = 600.0  # simulated seconds with no arrival or finish: give up (lost jobs)


@dataclass(frozen=True)
class SimConfig:
    num_tes: int = 1024
    num_models: int = 4
    mix: tuple[int, int, int] = (2, 1, 1)  # colocated : prefill : decode TEs of a model
    policy: str = "combined"
    pd_mode: str = "heatmap"
    num_requests: int = 4000
    load: float = 0.4  # offered requests per second per TE
    burst: tuple[float, float, float] | None = None  # (start s, end s, rate factor)
    max_scale: float = 2.0  # a model's max_tes = its initial TEs * max_scale
    tick_s: float = 0.5  # CM step
    seed: int = 0
    profile: Profile = Profile()

    def __post_init__(self):
        if self.num_models < 1 or self.num_tes < self.num_models:
            raise ValueError(f"need num_tes >= num_models >= 1, got {self.num_tes}, "
                             f"{self.num_models}")
        if len(self.mix) != 3 or not (self.mix[0] > 0 or min(self.mix[1:]) > 0):
            raise ValueError(f"mix {self.mix}: colocated, or prefill and decode, TEs needed")


def split(total: int, weights: tuple[int, ...]) -> list[int]:
    """total apportioned by weights (largest remainder)."""
    raw = [total * w / sum(weights) for w in weights]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: counts[i] - raw[i])[:total - sum(counts)]:
        counts[i] += 1
    return counts


class ClusterSim:
    def __init__(self, cfg: SimConfig):
        self.cfg, self.now, self.rng = cfg, 0.0, random.Random(cfg.seed)
        self.models = [f"m{i}" for i in range(cfg.num_models)]
        self.workload = Workload(self.rng, self.models, cfg.profile.block_size)
        self.router = Router(cfg.policy, block_size=cfg.profile.block_size,
                             index=GlobalPromptIndex(clock=lambda: self.now))
        self.pd = PDPolicy.from_files(cfg.pd_mode, ROOT / "conf" / "pd_heatmap.json",
                                      ROOT / "conf" / "decode_predictor.json")
        self.book = ModelBook({m: m for m in self.models})
        self.heap: list = []
        self.seq = itertools.count()
        self.stats = Stats()
        self.arrivals: Counter[str] = Counter()
        self.parked: list[Job] = []
        self.num_planned = self.num_finished = 0
        self.last_progress = 0.0
        self.routable: Counter[tuple[str, str]] = Counter()  # (model, type) -> TEs
        initial = dict(zip(self.models, split(cfg.num_tes, (1,) * cfg.num_models)))
        policies = [ModelPolicy(m, min_tes=1, max_tes=max(n, math.ceil(n * cfg.max_scale)))
                    for m, n in initial.items()]
        self.cm = SimClusterManager(policies, cfg.mix, cfg.profile, self._at, lambda: self.now,
                                    self._on_list, self.stats)
        self.sims = self.cm.sims
        for m, n in initial.items():
            for te_type, k in zip(TYPES, split(n, cfg.mix)):
                for _ in range(k):
                    self.cm.te_up(m, te_type, push=False)
        self.cm.push()

    # -- event loop -----------------------------------------------------------------
    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def run(self) -> dict:
        self._at(0.0, self._new_session)
        self._at(REPORT_INTERVAL_S, self._report_tick)
        self._at(self.cfg.tick_s, self._scale_tick)
        started = perf_counter()
        while self.heap and self.num_finished < self.cfg.num_requests:
            self.now, _, fn, args = heapq.heappop(self.heap)
            fn(*args)
            self.stats.num_events += 1
            if self.now - self.last_progress > IDLE_STOP_S:
                break
        self.stats.wall_s = perf_counter() - started
        return self.stats.summary(self, probe(self.router, self.stats.samples))

    def _rate(self) -> float:
        """Sessions per second now: --load requests per TE, divided by the mean turns."""
        rate = self.cfg.load * self.cfg.num_tes / self.workload.mean_turns()
        b = self.cfg.burst
        return rate * b[2] if b and b[0] <= self.now < b[1] else rate

    def _new_session(self) -> None:
        left = self.cfg.num_requests - self.num_planned
        if left <= 0:
            return
        session = self.workload.new_session(left)
        self.num_planned += session.num_turns_left
        self._turn(session)
        self._at(self.now + self.rng.expovariate(self._rate()), self._new_session)

    def _turn(self, session) -> None:
        job = self.workload.next_job(session, self.now)
        self.arrivals[job.model] += 1
        self.last_progress = self.now
        self._dispatch(job)

    # -- job executor -----------------------------------------------------------------
    def _dispatch(self, job: Job) -> None:
        try:
            job.te_id, job.prefill_te = self._route(job)
        except NoTEAvailable:
            self.parked.append(job)
            return
        if job.prefill_te is None:
            self._wake(self.sims[job.te_id], self.sims[job.te_id].add(job, self.now))
            return
        self.sims[job.te_id].num_incoming += 1
        prefill = self.sims[job.prefill_te]
        self._wake(prefill, prefill.add(job, self.now))

    def _route(self, job: Job) -> tuple[str, str | None]:
        """What the JE does per job (job_executor.py _route / _job_layout), timed."""
        c0, t0 = thread_time(), perf_counter()
        model = self.book.te_model(job.model)
        types = self.router.te_types(model)
        t1 = perf_counter()
        layout = self.pd.decide(job.prompt, types).te_type
        t2 = perf_counter()
        hashes = PromptHashes(job.prompt)  # hashed in the first decide, once per job
        if layout == "disaggregated":
            first = self.router.decide(job.prompt, None, "prefill", model=model, hashes=hashes)
            te_id = self.router.decide(job.prompt, None, "decode", model=model,
                                       hashes=hashes).te_id
        else:
            first = self.router.decide(job.prompt, None, "colocated", model=model, hashes=hashes)
            te_id = first.te_id
        t3 = perf_counter()
        first_type = "prefill" if layout == "disaggregated" else "colocated"
        self.stats.on_decision(t1 - t0, t2 - t1, t3 - t2, thread_time() - c0, layout, first, job)
        self.stats.on_locality(job.session, first.te_id, self.routable[job.model, first_type])
        return te_id, (first.te_id if layout == "disaggregated" else None)

    # -- simulated TEs ----------------------------------------------------------------
    def _wake(self, te: SimTE, t: float | None) -> None:
        if t is not None:
            self._at(t, self._te_event, te, te.version)

    def _te_event(self, te: SimTE, version: int) -> None:
        if version != te.version or self.sims.get(te.info.te_id) is not te:
            return  # a plan that was cut, or a TE that is gone
        ended, prefilled = te.complete(self.now)
        for job in ended:
            self._finish(job)
        if prefilled is not None:
            delay = len(prefilled.prompt) * self.cfg.profile.kv_transfer_s_per_token
            self._at(self.now + delay, self._handoff, prefilled)
        self._wake(te, te.start(self.now))

    def _handoff(self, job: Job) -> None:
        te = self.sims.get(job.te_id)
        if te is None:
            self.stats.num_lost += 1
            return
        te.num_incoming -= 1
        self._wake(te, te.add(job, self.now))

    def _finish(self, job: Job) -> None:
        self.num_finished += 1
        self.last_progress = self.now
        self.stats.on_finish(job)
        if job.session.num_turns_left > 0:
            self._at(self.now + self.workload.think_time(), self._turn, job.session)

    def _report_tick(self) -> None:
        for te in list(self.sims.values()):
            if te.is_dirty or self.cm.is_draining(te.info.te_id):
                report = te.report()
                t0 = perf_counter()
                self.router.on_report(report)
                self.stats.on_report_s += perf_counter() - t0
                self.stats.num_reports += 1
                self.cm.on_report(report, te.info.model)
        self._at(self.now + REPORT_INTERVAL_S, self._report_tick)

    def _scale_tick(self) -> None:
        self.cm.step(self.arrivals, Counter(job.model for job in self.parked))
        self.arrivals.clear()
        self._at(self.now + self.cfg.tick_s, self._scale_tick)

    def _on_list(self, tes: list[TEInfo]) -> None:
        """The JE adopts a decoded TE list (job_executor.py _update_tes); parked jobs retry."""
        t0 = perf_counter()
        self.router.update_tes([te for te in tes if not te.draining])
        self.stats.update_s.append(perf_counter() - t0)
        self.routable = Counter((te.model, te.te_type) for te in self.router.tes.values())
        parked, self.parked = self.parked, []
        for job in parked:
            self._dispatch(job)


def pin_one_cpu() -> int | None:
    """Pin this process to one allowed CPU; its number (None: not supported)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def _ints(text: str, sep: str = ",") -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(sep))


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--tes", default=1024, help="simulated TEs (ignored with --te-counts)")
@click.option("--te-counts", default=None, help="one run per TE count, e.g. 64,256,1024,4096")
@click.option("--models", default=4, help="models, TEs split evenly among them")
@click.option("--mix", default="2:1:1", help="colocated:prefill:decode TEs of each model")
@click.option("--requests", default=4000, help="requests per run")
@click.option("--load", default=0.4, help="offered requests per second per TE")
@click.option("--policy", default="combined", help="router policy (control/je/routing/router.py)")
@click.option("--pd-mode", default="heatmap", help="PD policy mode (control/je/routing/pd_policy.py)")
@click.option("--profile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON of sim_model.Profile fields (service times)")
@click.option("--burst", default=None, help="START:END:FACTOR, simulated seconds")
@click.option("--seed", default=0)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--pin/--no-pin", default=True, help="pin the process to one CPU")
def main(tes, te_counts, models, mix, requests, load, policy, pd_mode, profile, burst, seed,
         json_path, pin):
    logging.getLogger("deepserve.control.cm.scaling").setLevel(logging.ERROR)  # a line per decision
    cpu = pin_one_cpu() if pin else None
    counts = _ints(te_counts) if te_counts else (tes,)
    burst_t = tuple(float(x) for x in burst.split(":")) if burst else None
    print(f"# pinned to CPU {cpu}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
          f"CPUs; {requests} requests per run, policy {policy}, PD {pd_mode}", flush=True)
    rows = []
    for n in counts:
        cfg = SimConfig(num_tes=n, num_models=models, mix=_ints(mix, ":"), policy=policy,
                        pd_mode=pd_mode, num_requests=requests, load=load, burst=burst_t,
                        seed=seed, profile=Profile.load(profile))
        rows.append(ClusterSim(cfg).run())
        print(table(rows[-1:], header=len(rows) == 1), flush=True)
    if json_path:
        config = asdict(cfg) | {"num_tes": list(counts), "pinned_cpu": cpu}
        Path(json_path).write_text(json.dumps({"config": config, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
