"""A chaos run's report: what the clients saw, what each fault did, what the
node held.

    {"seed", "conf", "duration_s", "load_s",
     "sent", "completed", "failed", "lost", "bad_streams",        sent = completed + failed + lost
     "mismatched", "ok", "failed_expected", "failed_typed",       (checks.py's outcomes)
     "failed_typed_by_type", "failed_untyped", "hostile_accepted",
     "by_kind": {chat|completion|hostile|poison: {"sent", "completed", "failed", "lost"}},
     "by_model": {model name: {"sent", "completed", "failed", "lost"}},
     "scaling": {"model", "to_zero", "from_zero", "decisions"}   (the scaled model's
                 scale decisions in the health log; __main__.py; absent without one)
     "faults": [{"kind", "planned_at_s", "at_s", "te", "components", "proven", "proof",
                 "detect_s", "recover_s", "state", "pid"}],
     "menu", "not_supported": {name: why}, "schedule": [...],
     "rates": [[t_s, completed, failed], ...]                     per RATE_BUCKET_S, by end time
     "resources": {"interval_s", "samples": [Sample], "growth_after_s", "growth"},
     "shm": {"prefixes", "left_at_end": [names], "back_to_baseline"},
     "examples": {"bad": [...], "lost": [...], "failed_typed": [...], "hostile_accepted": [...]},
     "notes": [...], "ok": bool}

ok (the exit status): nothing lost, no bad stream, no hostile request
accepted, and every fault proven.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from deepserve.chaos.checks import BAD, HOSTILE_ACCEPTED, LOST, TYPED, UNTYPED, Verdict, tally

RATE_BUCKET_S = 10.0
MAX_EXAMPLES = 20


def build_report(*, pairs, verdicts: list[Verdict], faults: list[dict], samples, duration_s: float,
                 load_s: float, t0: float, notes: list[str], completed_status: str,
                 models: list[str]) -> dict:
    records = [r for _, r in pairs]
    report = {"duration_s": duration_s, "load_s": round(load_s, 3), **tally(verdicts, records)}
    by_kind: dict[str, Counter] = {}
    for spec, record in pairs:
        by_kind.setdefault(spec.kind, Counter())["sent"] += 1
        by_kind[spec.kind][record.status] += 1
    report["by_kind"] = {k: dict(v) for k, v in sorted(by_kind.items())}
    by_model: dict[str, Counter] = {}
    for spec, record in pairs:
        by_model.setdefault(models[spec.model], Counter())["sent"] += 1
        by_model[models[spec.model]][record.status] += 1
    report["by_model"] = {k: dict(v) for k, v in by_model.items()}
    report["faults"] = faults
    report["rates"] = rates(records, t0, completed_status)
    report["resources"] = {"samples": [s.to_dict() for s in samples]}
    report["examples"] = _examples(pairs, verdicts)
    report["notes"] = list(notes)
    return report


def rates(records, t0: float, completed_status: str) -> list[list[float]]:
    """[bucket start (s since t0), completed, failed] per RATE_BUCKET_S, by end time."""
    ends = [(r.end - t0, r.status == completed_status) for r in records if r.end is not None]
    if not ends:
        return []
    num = int(max(t for t, _ in ends) // RATE_BUCKET_S) + 1
    out = [[i * RATE_BUCKET_S, 0, 0] for i in range(num)]
    for t, ok in ends:
        bucket = out[max(0, int(t // RATE_BUCKET_S))]
        bucket[1 if ok else 2] += 1
    return out


def _examples(pairs, verdicts) -> dict:
    out: dict[str, list] = {"bad": [], "lost": [], "failed_typed": [], "failed_untyped": [],
                            "hostile_accepted": []}
    names = {BAD: "bad", LOST: "lost", TYPED: "failed_typed", UNTYPED: "failed_untyped",
             HOSTILE_ACCEPTED: "hostile_accepted"}
    for (spec, record), verdict in zip(pairs, verdicts):
        name = names.get(verdict.outcome)
        if name is not None and len(out[name]) < MAX_EXAMPLES:
            out[name].append({"id": spec.id, "spec": spec.to_dict(), "why": verdict.reason,
                              "response_id": record.response_id, "start": record.start})
    return out


def is_ok(report: dict) -> bool:
    return (report["lost"] == 0 and report["bad_streams"] == 0
            and report["hostile_accepted"] == 0
            and all(f["proven"] for f in report["faults"]))


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def to_text(report: dict) -> str:
    lines = [f"seed {report.get('seed')}  load {report['load_s']:.0f} s  sent {report['sent']}  "
             f"completed {report['completed']}  failed {report['failed']}  "
             f"lost {report['lost']}  bad_streams {report['bad_streams']}",
             f"failed: expected {report['failed_expected']}  typed {report['failed_typed']} "
             f"{report['failed_typed_by_type'] or ''}  untyped {report['failed_untyped']}  "
             f"hostile accepted {report['hostile_accepted']}"]
    for name, counts in (report.get("by_model") or {}).items():
        lines.append(f"model {name}: " + "  ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    scaling = report.get("scaling")
    if scaling:
        lines.append(f"model {scaling['model']}: scaled to zero {scaling['to_zero']} times, "
                     f"from zero {scaling['from_zero']}")
    for f in report["faults"]:
        lines.append(f"  fault {f['kind']:<15} at {_s(f['at_s'])} ({f['te']})  "
                     f"proven {'yes' if f['proven'] else 'NO'}  detect {_s(f['detect_s'])}  "
                     f"recover {_s(f['recover_s'])}  {'' if f['proven'] else f['proof']}")
    growth = report.get("resources", {}).get("growth") or {}
    if growth:
        lines.append(f"growth after {growth['from_s']:.0f} s: rss "
                     f"{growth['rss_bytes'] / 2**20:+.1f} MiB, fds {growth['num_fds']:+d}, shm "
                     f"{growth['shm_bytes'] / 2**20:+.1f} MiB")
    shm = report.get("shm") or {}
    if shm:
        lines.append(f"/dev/shm back to baseline: {'yes' if shm['back_to_baseline'] else 'NO'} "
                     f"{shm['left_at_end'] or ''}")
    lines.extend(report.get("notes") or ())
    lines.append("verdict: " + ("PASS" if report.get("ok") else "FAIL"))
    return "\n".join(lines)


def _s(value) -> str:
    return "-" if value is None else f"{value:.1f} s"
