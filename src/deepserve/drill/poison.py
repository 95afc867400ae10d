"""The `poison` drill: one request of death under load (issue 11).

    inject: hook file teN.worker0.poison = the marker's token ids, on every
            worker of every TE of the target's type (faults.py: a worker that
            sees the marker among a step's new tokens exits 13, as on a segfault)
    POISON_DELAY_S later: one request whose prompt is given as token ids and
            ends with the marker (PoisonRequest, its own thread)
    the JE (control/je/suspects.py): the first TE crash makes it a suspect and
            the gateway resumes it; the second crash quarantines it:
            500 request_crashed_engine + a `request_quarantined` event

Proof (Quarantined, beside HookFired): exactly one `request_quarantined`
event after the fault (an innocent request quarantined too fails the drill),
and the client saw the poison fail with code request_crashed_engine (a 500
before its first token carries no response id to match the event's with).
Recovered: the poison request ended, every TE that restarted since the
fault is back from its last restart ("recovered"), and a load request
completed after that. Reported in details["poison"]: TEs restarted
(`restarting` events of TEs after the fault), the poison's outcome, and the
load's 503s (healthy requests refused: availability).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from deepserve.drill.health_events import HealthEvents, te_of
from deepserve.drill.load import LoadDriver
from deepserve.drill.proof import FaultProof
from deepserve.drill.stream import COMPLETED, RequestRecord, first_success_after

MARKER_TEXT = " POISON-7f3a request of death"
LEAD_TEXT = "Please summarize:"
POISON_DELAY_S = 0.5
"""After the hook files are written: every busy worker has read them by then."""
QUARANTINED = "request_quarantined"
CRASHED = "request_crashed_engine"


def poison_ids(model_dir: str | None) -> tuple[list[int], list[int]]:
    """(marker ids, the poison prompt's ids: a lead + the marker), from the
    model's tokenizer; without one, ids every vocabulary has (< 256)."""
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(model_dir or "") / "tokenizer.json"))
        marker, lead = tok.encode(MARKER_TEXT).ids, tok.encode(LEAD_TEXT).ids
    except Exception:  # noqa: BLE001 - no tokenizer at hand: fixed ids
        marker, lead = [211, 97, 173, 59, 241, 13], [71, 83, 5]
    return list(marker), list(lead) + list(marker)


class PoisonRequest:
    """Sends the poison request once, in a thread, and keeps its record."""

    def __init__(self, driver: LoadDriver, prompt_ids: list[int]):
        self.driver, self.prompt_ids = driver, prompt_ids
        self.record: RequestRecord | None = None
        self.sent_at: float | None = None
        self._thread: threading.Thread | None = None

    def start(self, delay_s: float = POISON_DELAY_S) -> None:
        def send() -> None:
            time.sleep(delay_s)
            self.sent_at = time.time()
            self.record = self.driver.send_sync(self.prompt_ids)

        self._thread = threading.Thread(target=send, name="drill-poison", daemon=True)
        self._thread.start()

    @property
    def is_done(self) -> bool:
        return self.record is not None

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def outcome(self) -> dict:
        r = self.record
        if r is None:
            return {"status": "not ended"}
        return {"status": r.status, "http_status": r.http_status, "error_code": r.error_code,
                "error": r.error, "response_id": r.response_id}


class Quarantined(FaultProof):
    """One request_quarantined event after the fault, and the poison request
    failed as request_crashed_engine."""

    def __init__(self, events: HealthEvents, poison: PoisonRequest, since: float):
        super().__init__()
        self.events, self.poison, self.since = events, poison, since
        self.event: dict | None = None

    def _is_shown(self) -> bool:
        return self.event is not None

    def poll(self, t: float) -> None:
        if self.is_settled or not self.poison.is_done:
            if t == float("inf") and not self.is_settled:
                self.failure = "the poison request never ended"
            return
        r = self.poison.record
        if r.error_code != CRASHED:
            self.failure = (f"the poison request ended {r.status} ({r.error_code}: {r.error}), "
                            f"not as {CRASHED}")
            return
        found = [e for e in self.events.events(self.since) if e.get("event") == QUARANTINED]
        if len(found) > 1:  # only the poison may be quarantined: the rest were innocent
            ids = [(e.get("details") or {}).get("request_id") for e in found]
            self.failure = f"{len(found)} requests quarantined, not one: {ids}"
        elif found:
            self.event = found[0]
            details = self.event.get("details") or {}
            self.evidence.append(f"{QUARANTINED} {details.get('request_id')} after crashes of "
                                 f"{details.get('crashed_tes')} +{self.event['t'] - self.since:.3f}"
                                 f" s; the client saw {r.http_status} {CRASHED}")
        elif t == float("inf"):
            self.failure = f"no {QUARANTINED} event after the fault"


def te_restarts(events: HealthEvents, since: float) -> list[str]:
    """The TEs the supervisor restarted since `since`, one entry per restart."""
    return [te_of(str(e.get("component", ""))) for e in events.events(since)
            if e.get("event") == "restarting" and str(e.get("component", "")).startswith("te")]


def has_recovered(events: HealthEvents, poison: PoisonRequest, since: float,
                  records: list[RequestRecord]) -> bool:
    """The poison ended, each restarted TE is back from its last restart, and a
    load request completed after that."""
    if not poison.is_done:
        return False
    back = []
    for te in set(te_restarts(events, since)):
        last = [e["t"] for e in events.events(since) if e.get("event") == "restarting"
                and te_of(str(e.get("component", ""))) == te][-1]
        recovered = events.first(last, {"recovered"}, te)
        if recovered is None:
            return False
        back.append(recovered["t"])
    after = max([poison.record.end or since, *back])
    return first_success_after(records, after) is not None


def summary(events: HealthEvents, poison: PoisonRequest, since: float,
            records: list[RequestRecord]) -> dict:
    """details["poison"] of the report."""
    restarts = te_restarts(events, since)
    refused = [r.id for r in records if r.http_status == 503
               or r.error_type == "service_unavailable"]
    return {"te_restarts": len(restarts), "num_tes_restarted": len(set(restarts)),
            "restarted_tes": restarts,
            "poison": poison.outcome(), "load_503": len(refused), "load_503_ids": refused[:20],
            "load_completed": sum(r.status == COMPLETED for r in records)}
