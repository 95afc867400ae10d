"""Every chaos request checked: against the oracle, or as an expected failure.

    RequestRecord (drill/stream.py) + its RequestSpec ──check──> Verdict(outcome, reason)

    outcome            when
    ok                 completed; every choice exactly the oracle's greedy ids
    bad                ids contradict the oracle (a wrong, repeated or extra token;
                       a short completed choice; a choice index past n; usage that
                       does not count the ids) or the stream was not what the
                       gateway sends (protocol_error): a bad stream
    lost               no end before the client's deadline (drill/load.py)
    expected_failure   hostile: a 4xx with an OpenAI error body; poison: failed
                       as request_crashed_engine; any request whose connection
                       failed while a killed gateway was down (explain_cuts)
    failed_typed       any other failure with an OpenAI error body (its type counts)
    failed_untyped     a failure without one: connection cut, a stream ended
                       without finish_reason, an HTTP error without an error body
    hostile_accepted   a hostile request not answered 4xx + error body

The oracle (`Oracle`) holds each key's greedy ids: asked once per key before
any fault (runner.py). ids are compared with drill/report.py's ids_reason, so
a drill and a chaos run judge a stream by the same rule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from deepserve.chaos.workload import HOSTILE, POISON, RequestSpec
from deepserve.drill.report import ids_reason
from deepserve.drill.stream import (COMPLETED, CONNECTION_ERROR, FAILED, HTTP_ERROR,
                                    INCOMPLETE_STREAM, LOST, PROTOCOL_ERROR, RequestRecord)

OK, BAD, EXPECTED, TYPED, UNTYPED, HOSTILE_ACCEPTED = (
    "ok", "bad", "expected_failure", "failed_typed", "failed_untyped", "hostile_accepted")
UNTYPED_ERRORS = frozenset({CONNECTION_ERROR, INCOMPLETE_STREAM, HTTP_ERROR})
CRASHED_ENGINE = "request_crashed_engine"


@dataclass(frozen=True)
class Verdict:
    outcome: str
    reason: str | None = None


class Oracle:
    """key -> the greedy token ids of an unfaulted run (RequestSpec.key)."""

    def __init__(self, answers: dict[tuple, list[int]] | None = None):
        self.answers: dict[tuple, list[int]] = dict(answers or {})

    def __contains__(self, key: tuple) -> bool:
        return key in self.answers

    def add(self, key: tuple, record: RequestRecord) -> None:
        """The oracle's own request for `key`; it must have completed."""
        if record.status != COMPLETED:
            raise RuntimeError(f"the oracle's request for {key} did not complete: "
                               f"{record.status} ({record.error_type}: {record.error})")
        self.answers[key] = list(record.choice_ids.get(0, record.token_ids))

    def check(self, spec: RequestSpec, record: RequestRecord) -> Verdict:
        if record.status == LOST:
            return Verdict(LOST, "no end before the client's deadline")
        if spec.kind == HOSTILE:
            return _hostile(spec, record)
        if record.error_type == PROTOCOL_ERROR:
            return Verdict(BAD, f"protocol error: {record.error}")
        if spec.kind == POISON:
            if record.error_code == CRASHED_ENGINE:
                return Verdict(EXPECTED)
            return Verdict(TYPED if record.status == FAILED else OK,
                           f"poison ended {record.status} ({record.error_code})")
        reason = self._ids_reason(spec, record)
        if reason is not None:
            return Verdict(BAD, reason)
        if record.status == COMPLETED:
            return Verdict(OK)
        if record.error_type in UNTYPED_ERRORS:
            return Verdict(UNTYPED, f"{record.error_type}: {record.error}")
        return Verdict(TYPED, f"{record.error_type}: {record.error}")

    def _ids_reason(self, spec: RequestSpec, record: RequestRecord) -> str | None:
        reference = self.answers.get(spec.key)
        if reference is None:
            raise KeyError(f"no oracle answer for {spec.key}")
        extra = sorted(i for i in record.choice_ids if not 0 <= i < spec.n)
        if extra:
            return f"choice index(es) {extra} past n = {spec.n}"
        completed = record.status == COMPLETED
        for i in range(spec.n):
            ids = record.choice_ids.get(i, [])
            why = ids_reason(ids, reference, record.max_tokens, completed)
            if why is not None:
                return f"choice {i}: {why}" if spec.n > 1 else why
            if completed and i not in record.finish_reasons:
                return f"choice {i} has no finish_reason"
        counted = (record.usage or {}).get("completion_tokens")
        num_ids = sum(len(ids) for ids in record.choice_ids.values())
        if completed and counted is not None and counted != num_ids:
            return f"usage says {counted} completion tokens, the response had {num_ids}"
        return None


CUT_ERRORS = frozenset({CONNECTION_ERROR, INCOMPLETE_STREAM})
"""How a request the gateway died under (or one sent before it listens again) ends."""


def explain_cuts(records: list[RequestRecord], verdicts: list[Verdict],
                 windows: list[tuple[float, float]]) -> list[Verdict]:
    """Verdicts with each connection failure of a request open in a window (epoch
    start, end: a gateway killed, until a request was served after it) made an
    expected failure: a gateway's open connections die with it, and the client
    sees that (issue 25: they end with a connection error)."""
    out = []
    for record, verdict in zip(records, verdicts):
        if verdict.outcome in (UNTYPED, HOSTILE_ACCEPTED) and record.error_type in CUT_ERRORS \
                and any(record.start <= end and (record.end or record.start) >= start
                        for start, end in windows):
            verdict = Verdict(EXPECTED, f"cut by a gateway kill: {record.error_type}")
        out.append(verdict)
    return out


def _hostile(spec: RequestSpec, record: RequestRecord) -> Verdict:
    status = record.http_status or 0
    typed = record.error_type is not None and record.error_type not in UNTYPED_ERRORS \
        and record.error_type != PROTOCOL_ERROR
    if record.status == FAILED and 400 <= status < 500 and typed:
        return Verdict(EXPECTED)
    return Verdict(HOSTILE_ACCEPTED, f"{spec.hostile}: HTTP {record.http_status} "
                                     f"{record.status} ({record.error_type}: {record.error})")


def tally(verdicts: list[Verdict], records: list[RequestRecord]) -> dict:
    """The counts of a run: sent = completed + failed + lost (by record status),
    bad_streams across them, failures split by outcome and error type."""
    by_status = Counter(r.status for r in records)
    outcomes = Counter(v.outcome for v in verdicts)
    typed = Counter(r.error_type or "?" for r, v in zip(records, verdicts) if v.outcome == TYPED)
    return {"sent": len(records), "completed": by_status[COMPLETED],
            "failed": by_status[FAILED], "lost": by_status[LOST], "bad_streams": outcomes[BAD],
            "mismatched": sum(1 for r, v in zip(records, verdicts)
                              if v.outcome == BAD and r.status == COMPLETED),
            "ok": outcomes[OK], "failed_expected": outcomes[EXPECTED],
            "failed_typed": outcomes[TYPED], "failed_typed_by_type": dict(typed),
            "failed_untyped": outcomes[UNTYPED], "hostile_accepted": outcomes[HOSTILE_ACCEPTED]}
