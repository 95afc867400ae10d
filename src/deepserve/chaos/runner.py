"""One chaos run against a started node: contexts, oracle, load + faults +
samples for the duration, then every request checked.

    wait until /health lists every TE
    -> contexts: POST /v1/contexts, each tenant x CONTEXTS (refused: none used)
    -> oracle: every key the workload may send, once, greedy, before any fault
    -> t0: load thread (load.py), resource sampler (resources.py)
    -> main loop, every POLL_S, until t0 + duration and every fault settled:
         a planned fault's time come: FaultTask(...).start()   (faults.py),
         unless an open fault writes the same hook files: then once that one ended
         (else the first one's cleanup would lift the second's files)
       (past the end: no new fault; open ones watched up to their own bound)
    -> stop load (open requests end or are lost at their deadline), last sample
    -> verdicts (checks.py; a connection failure while a killed gateway was down is
       an expected one), faults' outcomes, the report dict (report.py)
"""

from __future__ import annotations

import asyncio
import threading
import time

from deepserve.chaos.checks import Oracle, explain_cuts
from deepserve.chaos.faults import FaultTask
from deepserve.chaos.load import ChaosLoad
from deepserve.chaos.report import build_report
from deepserve.chaos.resources import ResourceSampler
from deepserve.chaos.schedule import PlannedFault
from deepserve.chaos.workload import CONTEXTS, POISON, RequestSpec, Workload
from deepserve.drill.runner import POLL_S
from deepserve.drill.target import wait_tes
from deepserve.drill.stream import COMPLETED

SETTLE_S = 2.0
"""Load kept running this long after the last fault settled."""


class ChaosRun:
    def __init__(self, *, url: str, config, log_dir, drill_dir, workload: Workload,
                 schedule: list[PlannedFault], duration_s: float, concurrency: int = 3,
                 request_timeout_s: float = 60.0, sample_every_s: float = 10.0,
                 root_pid: int, shm_prefixes: list[str], names=None, echo=lambda msg: None):
        self.url, self.config, self.log_dir, self.drill_dir = url, config, log_dir, drill_dir
        self.workload, self.schedule, self.duration_s = workload, schedule, duration_s
        self.echo = echo
        self.load = ChaosLoad(url, workload, concurrency=concurrency,
                              request_timeout_s=request_timeout_s)
        self.sample_every_s, self.root_pid = sample_every_s, root_pid
        self.shm_prefixes, self.names = shm_prefixes, names
        self.oracle = Oracle()
        self.notes: list[str] = []
        self.tasks: list[FaultTask] = []  # started
        self.due: list[FaultTask] = []  # their time came; waiting for hook files to free up
        self.waiting_noted: set[FaultTask] = set()
        self.t0: float | None = None
        self.sampler: ResourceSampler | None = None

    # -- before t0 ------------------------------------------------------------------------
    def prepare(self, startup_timeout_s: float = 300.0) -> None:
        wait_tes(self.url, len(self.config.tes), startup_timeout_s)
        asyncio.run(self._prepare())
        self.echo(f"oracle: {len(self.oracle.answers)} greedy answers; contexts: "
                  f"{len(self.workload.contexts)}")

    async def _prepare(self) -> None:
        w = self.workload
        async with self.load.client() as client:
            for tenant in range(len(w.tenants)):
                for name in CONTEXTS:
                    response = await client.post(
                        "/v1/contexts", json=w.context_body(name, self.duration_s + 3600),
                        headers=w.auth(tenant), timeout=self.load.deadline_s)
                    if response.status_code != 200:
                        self.notes.append(f"contexts off: POST /v1/contexts answered "
                                          f"{response.status_code} {response.text[:200]}")
                        w.contexts.clear()
                        break
                    w.contexts[(tenant, name)] = response.json()["id"]
                if not w.contexts:
                    break
            for spec in w.oracle_specs(w.all_keys()):
                self.oracle.add(spec.key, await self.load.send(client, spec))

    # -- t0 .. end ------------------------------------------------------------------------
    def run(self) -> dict:
        self.t0 = time.time()
        self.sampler = ResourceSampler(self.root_pid, self.shm_prefixes,
                                       self.config.node.disk_cache_dir or None, self.t0,
                                       self.sample_every_s, self.names)
        self.sampler.begin()
        thread = threading.Thread(target=self.load.run_sync, name="chaos-load", daemon=True)
        thread.start()
        try:
            self._loop(thread)
        finally:
            self.load.stop()
            thread.join(self.load.deadline_s + 30)
            for task in self.tasks:
                task.join(5)
            self.sampler.sample()  # the last look, the node still up
            self.sampler.stop()
        load_s = time.time() - self.t0
        return self._report(load_s)

    def _loop(self, thread: threading.Thread) -> None:
        pending = sorted(self.schedule, key=lambda f: f.at_s)
        end = self.t0 + self.duration_s
        while thread.is_alive():
            t = time.time()
            while pending and t >= self.t0 + pending[0].at_s and t < end:
                self.due.append(self._task(pending.pop(0)))
            self._start_due()
            open_tasks = [task for task in self.tasks if not task.is_done]
            if t >= end and not open_tasks:
                time.sleep(SETTLE_S)
                return
            if t >= end + self._bound():
                self.echo("faults still open past their bound: stopping")
                return
            time.sleep(POLL_S)
        self.notes.append("the load thread ended early")

    def _bound(self) -> float:
        return max((task.bound_s for task in self.tasks), default=0.0) + 60.0

    def _task(self, planned: PlannedFault) -> FaultTask:
        return FaultTask(planned, url=self.url, model=self.workload.model, config=self.config,
                         log_dir=self.log_dir, drill_dir=self.drill_dir,
                         driver=self._fault_driver(), records=self.load.records, t0=self.t0,
                         echo=self.echo)

    def _start_due(self) -> None:
        """Start the due faults, in order, except one that would write the hook
        files of a fault still open (then it waits for that one to end)."""
        for task in list(self.due):
            p = task.planned
            busy = [t for t in self.tasks if not t.is_done and t.shares_hooks_with(task)]
            if busy:
                if task not in self.waiting_noted:
                    self.waiting_noted.add(task)
                    self.echo(f"+{time.time() - self.t0:.1f} s fault {p.scenario} waits: "
                              f"its hook files are another open fault's")
                continue
            self.due.remove(task)
            self.echo(f"+{time.time() - self.t0:.1f} s fault {p.scenario}"
                      f"{' -> ' + p.te if p.te else ''}")
            self.tasks.append(task)
            task.start()

    def _fault_driver(self):
        """The driver a fault sends its own requests with (cache probe, poison): the first
        tenant's key, the load's deadline."""
        from deepserve.drill.load import LoadDriver
        return LoadDriver(self.url, self.workload.model, prompts=["-"],
                          api_key=self.workload.tenants[0], max_tokens=self.workload.max_tokens,
                          request_timeout_s=self.load.sender.request_timeout_s)

    # -- the verdict ----------------------------------------------------------------------
    def _gateway_down(self, faults: list[dict]) -> list[tuple[float, float]]:
        """(epoch start, end) of each gateway kill: until a request was served
        after it (its recover_s), else its watch bound."""
        return [(self.t0 + f["at_s"],
                 self.t0 + f["at_s"] + (f["recover_s"] if f["recover_s"] is not None
                                        else task.bound_s))
                for task, f in zip(self.tasks, faults)
                if f["kind"] == "kill-gateway" and f["at_s"] is not None]

    def _report(self, load_s: float) -> dict:
        pairs = self.load.pairs()
        for i, task in enumerate(self.tasks):
            poison = task.poison_record()
            if poison is not None:  # the request of death is the poison's, failing as expected
                pairs.append((RequestSpec(-1000 - i, POISON), poison))
        records = [r for _, r in pairs]
        faults = [task.outcome(records) for task in self.tasks]
        verdicts = [self.oracle.check(spec, record) for spec, record in pairs]
        verdicts = explain_cuts(records, verdicts, self._gateway_down(faults))
        return build_report(pairs=pairs, verdicts=verdicts, faults=faults,
                            samples=self.sampler.samples(), duration_s=self.duration_s,
                            load_s=load_s, t0=self.t0, notes=self.notes,
                            completed_status=COMPLETED, models=self.workload.models)
