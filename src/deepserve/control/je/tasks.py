"""What the job executor keeps per task, and the words of its health events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

CRASHED = "request_crashed_engine"
"""RequestFailed.error of a quarantined request (the gateway: 500, this code)."""


class EventSink(Protocol):
    """A health-log event out (ActorLife.event in the process; a list in tests)."""

    def __call__(self, event: str, **details) -> None: ...


def no_event(event: str, **details) -> None:
    pass


@dataclass
class Task:
    request_id: str
    te_id: str  # the TE that streams to the caller (colocated or decode)
    reply_to: str | None
    prefill_te: str | None = None  # disaggregated: where its KV is computed
    attempt: int = 0
    is_suspect: bool = False  # resumed isolated after a crash (module doc)


def crashed_text(crashes: list[str]) -> str:
    """For the tenant: what happened, without naming TEs (the event names them)."""
    return (f"The request was in flight each time an engine crashed ({len(crashes)} crashes); "
            "it is quarantined as a likely cause and will not be retried.")
