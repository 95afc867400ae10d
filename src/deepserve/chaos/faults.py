"""One scheduled fault of a chaos run, driven by the drill's own machinery.

    FaultTask (its own thread, started at its planned time):
        drill.runner.Drill(scenario, te)  ──arm(driver, records=the chaos load)──>
            pid known (signals; waits while the TE restarts) · poison made · cache probe
        ──inject()──> fault_at            (drill/injection.py)
        ──poll(t) every POLL_S──> "recovered" | "unproven" | "timeout"   (drill/proof.py)
        ──cleanup()                       (no hook file left, nothing left stopped)
    after the load ended: outcome(records) -> detect_s, recover_s, proven, proof

Faults overlap: each task has its own Drill; the proofs are by pid and by
each component's own fault_injected event, so a second fault does not prove
the first. Detection and recovery are the drill's rules (the first detection
event of the target TE after the fault, its "recovered" event, or the first
completion after the fault for faults nothing restarts).
"""

from __future__ import annotations

import threading
import time

from deepserve.chaos.schedule import PlannedFault
from deepserve.drill.load import LoadDriver
from deepserve.drill.runner import POLL_S, Drill
from deepserve.drill.scenarios import get_scenario
from deepserve.drill.stream import RequestRecord, now


class FaultTask:
    def __init__(self, planned: PlannedFault, *, url: str, model: str, config, log_dir,
                 drill_dir, driver: LoadDriver, records, t0: float, echo=lambda msg: None):
        self.planned, self.t0, self.echo = planned, t0, echo
        self.scenario = get_scenario(planned.scenario)
        self.drill = Drill(self.scenario, url=url, model=model, config=config, log_dir=log_dir,
                           drill_dir=drill_dir, te=planned.te, fire_bound_s=30.0,
                           echo=lambda msg: echo(f"[{planned.scenario}] {msg}"))
        self.driver, self.records = driver, records
        self.fault_at: float | None = None
        self.state: str | None = None
        """None while watching; "recovered", "unproven", "timeout", or "error"."""
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"chaos-{planned.scenario}")

    def start(self) -> None:
        self._thread.start()

    @property
    def is_done(self) -> bool:
        return not self._thread.is_alive() and self._thread.ident is not None

    def shares_hooks_with(self, other: "FaultTask") -> bool:
        return shares_hooks(self.planned, other.planned)

    @property
    def bound_s(self) -> float:
        """How long after injection it watches at most (the drill's recovery bound)."""
        return self.drill.bound_s

    def join(self, timeout_s: float) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self.drill.arm(self.driver, records=self.records)
            self.fault_at = self.drill.inject()
            while (state := self.drill.poll(now(), self.fault_at)) is None:
                time.sleep(POLL_S)
            self.state = state
        except Exception as exc:  # noqa: BLE001 - reported as this fault's failure
            self.state, self.error = "error", f"{type(exc).__name__}: {exc}"
            self.echo(f"[{self.planned.scenario}] could not run: {self.error}")
        finally:
            try:
                self.drill.cleanup()
            except Exception as exc:  # noqa: BLE001
                self.echo(f"[{self.planned.scenario}] cleanup: {exc!r}")

    def poison_record(self) -> RequestRecord | None:
        poison = self.drill.poison
        return poison.record if poison is not None else None

    def outcome(self, records: list[RequestRecord]) -> dict:
        """The report's entry; call once the load ended."""
        p = self.planned
        entry = {"kind": p.scenario, "planned_at_s": p.at_s, "te": self.drill.te,
                 "components": list(self.drill.injection.components),
                 "at_s": None, "proven": False, "proof": self.error, "detect_s": None,
                 "recover_s": None, "state": self.state or "unfinished"}
        if self.fault_at is None or self.drill.proof is None:
            entry["proof"] = self.error or "never injected"
            return entry
        if self.drill.poison is not None:
            self.drill.poison.join(self.driver.deadline_s + 1.0)
        # no last look: by now other faults may have hit the same TE (a slow-worker
        # "detected" when a later hang on that TE was)
        detected_at, recovered_at = self.drill.outcome(records, self.fault_at, last_look=False)
        proof = self.drill.proof
        entry.update(at_s=round(self.fault_at - self.t0, 3), proven=proof.is_proven,
                     proof="; ".join(proof.evidence) if proof.is_proven else proof.failure,
                     detect_s=_delta(detected_at, self.fault_at),
                     recover_s=_delta(recovered_at, self.fault_at),
                     pid=self.drill.injection.pid)
        return entry


def _delta(at: float | None, since: float) -> float | None:
    return None if at is None else round(at - since, 3)


def hook_key(planned: PlannedFault) -> tuple[str, str] | None:
    """(hook fault, its TE or "*" for every TE of a type, or the node process)
    for a fault made of hook files, else None (signals); the disk faults share
    one key: a second disk-full's tier_disabled would never come, and a
    corrupt-disk during a disk-full finds no file written to corrupt."""
    s = get_scenario(planned.scenario)
    if s.needs_disk:
        return "disk", s.part
    if s.is_signal:
        return None
    if s.node_process:
        return s.fault, s.part
    return s.fault, "*" if s.every_te_of_type else (planned.te or "")


def shares_hooks(a: PlannedFault, b: PlannedFault) -> bool:
    """The two would write the same hook files: the first one's cleanup would
    lift the second (seen: overlapping poison faults whose requests completed)."""
    ka, kb = hook_key(a), hook_key(b)
    if ka is None or kb is None or ka[0] != kb[0]:
        return False
    return ka[1] == kb[1] or "*" in (ka[1], kb[1])
