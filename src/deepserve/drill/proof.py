"""Proof that a drill's fault took effect: a drill whose fault did not happen fails.

    runner loop ──poll(t)──> FaultProof ──HealthEvents──> health.jsonl
    end of load ──finish(records)──> proven, or `failure` (why not)

    proof            shown by                                            gives up
    HookFired        a `fault_injected` event of each target component   bound_s after the fault
                     with details.fault == the hook's fault
    SignalDetected   a "crashed" / "hung" / "heartbeat_missed" event     at the end of the drill
                     for the signalled pid (or a "crashed" of the same
                     TE's host or sibling once that pid is gone: the host
                     stops the TE when it loses a process, and may be
                     seen first)
    CacheMissed      the probe prompt: cached_tokens > 0 before the      with its HookFired
                     drop, fewer (0 unless a prefix is shared) right
                     after every target's fault_injected
    TransferResumed  a `request_migrated` event after the fault, and     at the end of the drill
                     the load's request with that id completed
    TECrashed        a "crashed" event of the target TE after the        at the end of the drill
                     fault (stage-die: the hook kills the decode TE)
    NodeLost         every killed pid gone, and a `te_removed` event     at the end of the drill
                     (the cluster manager's) for each of the node's TEs
    Logged           an event of that name (of the component, if given)  at the end of the drill
                     after the fault; poke(), called once the parts
                     before it are proven, may provoke it (disk-full: a
                     fresh prompt, so that a block is written)

A proof is settled once proven or failed; the runner stops waiting for
recovery when one fails (nothing more can be learnt), and never reports a
drill as passed while a proof is unsettled.
"""

from __future__ import annotations

from typing import Callable

from deepserve.drill.health_events import HealthEvents
from deepserve.drill.injection import is_gone
from deepserve.drill.stream import COMPLETED, RequestRecord

FAULT_INJECTED = "fault_injected"
PID_DETECTIONS = frozenset({"crashed", "hung", "heartbeat_missed"})
MIGRATED = "request_migrated"
TE_REMOVED = "te_removed"


class FaultProof:
    """One piece of proof; subclasses fill `evidence` and `failure`."""

    def __init__(self):
        self.evidence: list[str] = []
        self.failure: str | None = None

    @property
    def is_proven(self) -> bool:
        return self.failure is None and self._is_shown()

    @property
    def is_settled(self) -> bool:
        return self.failure is not None or self._is_shown()

    def poll(self, t: float) -> None:
        """Look again (t: now, epoch seconds); may settle the proof."""

    def finish(self, records: list[RequestRecord]) -> None:
        """The last look, after the load ended: whatever is unshown now failed."""
        self.poll(float("inf"))

    def _is_shown(self) -> bool:
        raise NotImplementedError


class HookFired(FaultProof):
    def __init__(self, events: HealthEvents, components: list[str], fault: str, since: float,
                 bound_s: float):
        super().__init__()
        self.events, self.components, self.fault = events, components, fault
        self.since, self.bound_s = since, bound_s
        self.fired: dict[str, dict] = {}

    def _is_shown(self) -> bool:
        return len(self.fired) == len(self.components)

    def poll(self, t: float) -> None:
        if self.is_settled:
            return
        for component in self.components:
            if component not in self.fired:
                event = self.events.first_where(self.since, lambda e, c=component: (
                    e.get("event") == FAULT_INJECTED and e.get("component") == c
                    and (e.get("details") or {}).get("fault") == self.fault))
                if event is not None:
                    self.fired[component] = event
                    self.evidence.append(f"{component} fault_injected {self.fault} "
                                         f"+{event['t'] - self.since:.3f} s")
        if not self._is_shown() and t > self.since + self.bound_s:
            missing = [c for c in self.components if c not in self.fired]
            self.failure = (f"the fault never fired: no fault_injected event ({self.fault}) "
                            f"from {', '.join(missing)} within {self.bound_s:g} s")

    def finish(self, records: list[RequestRecord]) -> None:
        self.poll(self.since)  # a last look, the bound not yet applied
        self.poll(float("inf"))


class SignalDetected(FaultProof):
    def __init__(self, events: HealthEvents, te: str, component: str, pid: int,
                 te_pid: int | None, since: float):
        super().__init__()
        self.events, self.te, self.component = events, te, component
        self.pid, self.te_pid, self.since = pid, te_pid, since
        self.detected: dict | None = None
        self.evidence.append(f"signal delivered to {component} pid {pid}")

    def _is_shown(self) -> bool:
        return self.detected is not None

    def _matches(self, e: dict) -> bool:
        if e.get("event") not in PID_DETECTIONS:
            return False
        if e.get("pid") == self.pid:
            return True
        # The TE's host exits as soon as it loses a process and stops the
        # rest, so the first crash logged may be the host's or a sibling's
        # (te0/master after te0/tokenizer was killed): it counts once the
        # signalled pid is gone, and only for a process of the same TE.
        component = e.get("component") or ""
        return (e.get("event") == "crashed" and is_gone(self.pid)
                and (component.startswith(f"{self.te}/")
                     or (component == self.te and self.te_pid is not None
                         and e.get("pid") == self.te_pid)))

    def poll(self, t: float) -> None:
        if self.is_settled:
            return
        self.detected = self.events.first_where(self.since, self._matches)
        if self.detected is not None:
            e = self.detected
            self.evidence.append(f"{e.get('component')} {e.get('event')} pid {e.get('pid')} "
                                 f"+{e['t'] - self.since:.3f} s")
        elif t == float("inf"):
            self.failure = (f"the signal reached {self.component} pid {self.pid}, but no "
                            f"{'/'.join(sorted(PID_DETECTIONS))} event for that pid followed")


class CacheMissed(FaultProof):
    """probe(): one request of the probe prompt; `before`: its cached_tokens
    on a repeat before the fault."""

    def __init__(self, fired: HookFired, probe: Callable[[], RequestRecord], before: int | None):
        super().__init__()
        self.fired, self.probe, self.before = fired, probe, before
        self.after: int | None = None
        if not before:
            self.failure = (f"the probe prompt was not cached before the drop (cached_tokens "
                            f"{before}): a miss after it would prove nothing")

    def _is_shown(self) -> bool:
        return self.after is not None

    def poll(self, t: float) -> None:
        if self.is_settled or not self.fired.is_proven:
            if self.fired.failure is not None and self.failure is None:
                self.failure = "no drop to probe: " + self.fired.failure
            return
        record = self.probe()
        if record.status != COMPLETED or record.cached_tokens is None:
            self.failure = (f"the probe after the drop did not complete with usage: "
                            f"{record.status} ({record.error_type}: {record.error})")
        elif record.cached_tokens >= self.before:
            self.failure = (f"the cache was not dropped: the probe had {record.cached_tokens} "
                            f"cached tokens after the drop, {self.before} before")
        else:
            self.after = record.cached_tokens
            self.evidence.append(f"probe cached_tokens {self.before} before the drop, "
                                 f"{self.after} right after")


class TransferResumed(FaultProof):
    def __init__(self, events: HealthEvents, since: float):
        super().__init__()
        self.events, self.since = events, since
        self.migrated: dict | None = None
        self.completed: RequestRecord | None = None

    def _is_shown(self) -> bool:
        return self.completed is not None

    @property
    def is_settled(self) -> bool:
        """Once a request was resumed, the rest shows only when the load ends."""
        return self.failure is not None or self.migrated is not None

    def poll(self, t: float) -> None:
        if self.migrated is None:
            self.migrated = self.events.first_where(self.since,
                                                    lambda e: e.get("event") == MIGRATED)

    def finish(self, records: list[RequestRecord]) -> None:
        self.poll(float("inf"))
        if self.migrated is None:
            self.failure = "no request_migrated event: no request was resumed after the fault"
            return
        request_id = str((self.migrated.get("details") or {}).get("request_id", ""))
        record = next((r for r in records if r.response_id
                       and request_id.startswith(r.response_id + "-")), None)
        if record is None or record.status != COMPLETED:
            self.failure = (f"{request_id} was resumed but did not complete: "
                            f"{record.status if record else 'not a drill request'}")
            return
        self.completed = record
        self.evidence.append(f"{request_id} resumed on {self.migrated['details'].get('te_id')} "
                             f"+{self.migrated['t'] - self.since:.3f} s and completed")


class TECrashed(FaultProof):
    """The target TE went down after the fault (a hook that kills it: stage-die)."""

    def __init__(self, events: HealthEvents, te: str, since: float):
        super().__init__()
        self.events, self.te, self.since = events, te, since
        self.crash: dict | None = None

    def _is_shown(self) -> bool:
        return self.crash is not None

    def poll(self, t: float) -> None:
        if self.crash is None:
            self.crash = self.events.first_where(self.since, lambda e: (
                e.get("event") == "crashed"
                and str(e.get("component", "")).split("/")[0] == self.te))
            if self.crash is not None:
                self.evidence.append(f"{self.crash['component']} crashed "
                                     f"+{self.crash['t'] - self.since:.3f} s")

    def finish(self, records: list[RequestRecord]) -> None:
        self.poll(float("inf"))
        if self.crash is None:
            self.failure = f"{self.te} did not crash after the fault: it never fired"


class NodeLost(FaultProof):
    """node: also the CM's node_lost for it (scale-across: the CM's placement saw it)."""

    def __init__(self, events: HealthEvents, te_ids: list[str], pids: list[int], since: float,
                 node: str | None = None):
        super().__init__()
        self.events, self.te_ids, self.pids, self.since = events, list(te_ids), pids, since
        self.removed: dict[str, dict] = {}
        self.gone = False
        self.node, self.lost = node, node is None

    def _is_shown(self) -> bool:
        return self.gone and set(self.removed) == set(self.te_ids) and self.lost

    def poll(self, t: float) -> None:
        if not self.gone and self.pids and all(is_gone(pid) for pid in self.pids):
            self.gone = True
            self.evidence.append(f"all {len(self.pids)} processes of the node are gone")
        for e in self.events.events(self.since):
            te = (e.get("details") or {}).get("te_id")
            if e.get("event") == TE_REMOVED and te in self.te_ids and te not in self.removed:
                self.removed[te] = e
                self.evidence.append(f"{te} removed: {e['details'].get('reason')} "
                                     f"(+{e['t'] - self.since:.3f} s)")
            if not self.lost and e.get("event") == "node_lost" \
                    and (e.get("details") or {}).get("node") == self.node:
                self.lost = True
                self.evidence.append(f"node {self.node} lost with {e['details'].get('tes')} "
                                     f"(+{e['t'] - self.since:.3f} s)")

    def finish(self, records: list[RequestRecord]) -> None:
        self.poll(float("inf"))
        if not self._is_shown() and self.failure is None:
            missing = sorted(set(self.te_ids) - set(self.removed))
            self.failure = (f"node kill not shown: pids gone {self.gone}, "
                            f"TEs never removed {missing}, node_lost seen {self.lost}")


class HeadLost(FaultProof):
    """kill-head: every pid of the head gone, then the standby's head_taken_over
    (its own cluster manager and job executor started: the fault reached it)."""

    def __init__(self, events: HealthEvents, pids: list[int], since: float):
        super().__init__()
        self.events, self.pids, self.since = events, pids, since
        self.gone = False
        self.taken: dict | None = None

    def _is_shown(self) -> bool:
        return self.gone and self.taken is not None

    def poll(self, t: float) -> None:
        if not self.gone and self.pids and all(is_gone(pid) for pid in self.pids):
            self.gone = True
            self.evidence.append(f"all {len(self.pids)} processes of the head are gone")
        if self.taken is None:
            self.taken = self.events.first(self.since, {"head_taken_over"}, None)
            if self.taken is not None:
                self.evidence.append(f"the standby took over (+{self.taken['t'] - self.since:.3f}"
                                     f" s): {self.taken['details']}")

    def finish(self, records: list[RequestRecord]) -> None:
        self.poll(float("inf"))
        if not self._is_shown() and self.failure is None:
            self.failure = (f"head kill not shown: pids gone {self.gone}, "
                            f"head_taken_over seen {self.taken is not None}")


class Logged(FaultProof):
    def __init__(self, events: HealthEvents, event: str, component: str | None, since: float,
                 after: FaultProof | None = None, poke: Callable[[], object] | None = None,
                 failure: str | None = None):
        super().__init__()
        self.events, self.event, self.component, self.since = events, event, component, since
        self.after, self.poke = after, poke
        self.found: dict | None = None
        self.failure = failure

    def _is_shown(self) -> bool:
        return self.found is not None

    def poll(self, t: float) -> None:
        if self.is_settled or (self.after is not None and not self.after.is_proven):
            return
        if self.poke is not None:
            poke, self.poke = self.poke, None
            poke()
        self.found = self.events.first_where(self.since, lambda e: (
            e.get("event") == self.event
            and (self.component is None or e.get("component") == self.component)))
        if self.found is not None:
            self.evidence.append(f"{self.found.get('component')} {self.event} "
                                 f"+{self.found['t'] - self.since:.3f} s")

    def finish(self, records: list[RequestRecord]) -> None:
        self.poll(float("inf"))
        if self.found is None and self.failure is None:
            self.failure = (f"no {self.event} event"
                            + (f" from {self.component}" if self.component else "")
                            + " after the fault")


class Proofs(FaultProof):
    """All of them: proven when each is, failed when one is."""

    def __init__(self, parts: list[FaultProof]):
        super().__init__()
        self.parts = parts

    def _is_shown(self) -> bool:
        return all(p.is_proven for p in self.parts)

    @property
    def is_settled(self) -> bool:
        return any(p.failure is not None for p in self.parts) or all(
            p.is_settled for p in self.parts)

    def poll(self, t: float) -> None:
        for part in self.parts:
            part.poll(t)
        self._collect()

    def finish(self, records: list[RequestRecord]) -> None:
        for part in self.parts:
            part.finish(records)
        self._collect()

    def _collect(self) -> None:
        self.evidence = [line for p in self.parts for line in p.evidence]
        self.failure = next((p.failure for p in self.parts if p.failure is not None), None)
