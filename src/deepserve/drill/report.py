"""A drill's verdict: how many requests ended how, bad streams, detect / recover times.

    {"scenario": str, "sent": int, "completed": int, "failed": int, "lost": int,
     "bad_streams": int, "deadline_s": float | null, "detect_s": float | null,
     "recover_s": float | null, "fault_proven": bool | null, "proof": str | null}

Exactly these keys are written (KEYS); anything else the builder knows stays
in `DrillReport.details`, which is never written. sent = completed + failed +
lost (a partition by RequestRecord.status); bad_streams counts across them.
fault_proven: whether the fault showed it took effect (drill/proof.py; null
when not judged), proof: its evidence, or why it is missing.

A stream is bad when its token ids contradict its prompt's greedy reference:
- any record (completed, failed or lost) whose ids are not a prefix of the
  reference (a wrong, repeated or missing token): bad;
- a completed record must in addition be the whole expected answer,
  reference[:max_tokens] (the reference may end sooner, at its stop), and,
  when the stream reported usage, completion_tokens == number of ids.
A failed (or lost) record whose partial ids are a correct prefix is not bad.

ok = no lost request, no bad stream, and the fault not unproven.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from deepserve.drill.stream import COMPLETED, FAILED, LOST, RequestRecord

KEYS = ("scenario", "sent", "completed", "failed", "lost", "bad_streams", "deadline_s",
        "detect_s", "recover_s", "fault_proven", "proof")


@dataclass
class DrillReport:
    scenario: str
    sent: int
    completed: int
    failed: int
    lost: int
    bad_streams: int
    deadline_s: float | None
    detect_s: float | None
    recover_s: float | None
    fault_proven: bool | None = None
    proof: str | None = None
    details: dict = field(default_factory=dict, repr=False, compare=False)
    """Not written: bad stream ids and why, failures by error type, lost ids."""

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.bad_streams == 0 and self.fault_proven is not False

    def to_dict(self) -> dict:
        return {key: getattr(self, key) for key in KEYS}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    def to_text(self) -> str:
        width = max(len(k) for k in KEYS) + 2
        lines = [f"{key:<{width}}{_fmt(key, getattr(self, key))}" for key in KEYS]
        why = []
        if self.lost:
            why.append(f"{self.lost} lost")
        if self.bad_streams:
            why.append(f"{self.bad_streams} bad stream(s)")
        if self.fault_proven is False:
            why.append(f"fault not proven: {self.proof}")
        verdict = "PASS" if self.ok else f"FAIL ({', '.join(why)})"
        lines.append(f"{'verdict':<{width}}{verdict}")
        return "\n".join(lines)


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if key.endswith("_s"):
        return f"{value:.3f} s"
    return str(value)


def ids_reason(ids: list[int], reference: list[int], max_tokens: int,
               completed: bool) -> str | None:
    """Why token ids `ids` contradict `reference` (greedy, up to max_tokens),
    or None: a wrong, repeated or extra token always; a short answer only when
    `completed`. Shared with bin/deepserve-chaos, which checks each choice."""
    for i, (got, want) in enumerate(zip(ids, reference)):
        if got != want:
            return f"token {i} is {got}, the reference has {want}"
    expected = reference[:max_tokens]
    if len(ids) > len(expected):
        return f"{len(ids)} tokens, the reference has {len(expected)}"
    if completed and len(ids) < len(expected):
        return f"completed with {len(ids)} tokens, the reference has {len(expected)}"
    return None


def bad_reason(record: RequestRecord, reference: list[int]) -> str | None:
    """Why `record`'s stream contradicts `reference`, or None if it does not."""
    ids = record.token_ids
    reason = ids_reason(ids, reference, record.max_tokens, record.status == COMPLETED)
    if reason is not None or record.status != COMPLETED:
        return reason
    usage = record.usage or {}
    counted = usage.get("completion_tokens")
    if counted is not None and counted != len(ids):
        return f"usage says {counted} completion tokens, the stream had {len(ids)}"
    return None


def _delta(at: float | None, fault_at: float | None) -> float | None:
    if at is None or fault_at is None:
        return None
    return at - fault_at


def build_report(scenario: str, records: list[RequestRecord], reference: dict[int, list[int]],
                 deadline_s: float | None, fault_at: float | None, detected_at: float | None,
                 recovered_at: float | None, fault_proven: bool | None = None,
                 proof: str | None = None) -> DrillReport:
    """The report of one drill. Times are on the records' clock (epoch seconds);
    detect_s / recover_s are None when fault_at or the event is unknown.
    fault_proven / proof: drill/proof.py's verdict (None: not judged).
    Raises ValueError if a record's prompt has no reference."""
    missing = sorted({r.prompt_index for r in records} - set(reference))
    if missing:
        raise ValueError(f"no reference for prompt index(es) {missing}")
    by_status = {COMPLETED: 0, FAILED: 0, LOST: 0}
    bad: dict[int, str] = {}
    errors: dict[str, int] = {}
    for r in records:
        if r.status not in by_status:
            raise ValueError(f"record {r.id} has status {r.status!r}")
        by_status[r.status] += 1
        if r.status == FAILED:
            errors[r.error_type or "?"] = errors.get(r.error_type or "?", 0) + 1
        reason = bad_reason(r, reference[r.prompt_index])
        if reason is not None:
            bad[r.id] = reason
    details = {"bad": bad, "errors": errors,
               "lost_ids": [r.id for r in records if r.status == LOST],
               "fault_at": fault_at, "detected_at": detected_at, "recovered_at": recovered_at}
    return DrillReport(scenario=scenario, sent=len(records), completed=by_status[COMPLETED],
                       failed=by_status[FAILED], lost=by_status[LOST], bad_streams=len(bad),
                       deadline_s=deadline_s, detect_s=_delta(detected_at, fault_at),
                       recover_s=_delta(recovered_at, fault_at), fault_proven=fault_proven,
                       proof=proof, details=details)
