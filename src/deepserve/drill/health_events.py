"""The node's health log as a drill reads it: events with epoch times, pids,
the first event of a kind after the fault.

    <log_dir>/health.jsonl (+ rotated .1 .2 ...) ──HealthEvents.events(since)──> [event + "t"]
                                                  ├─ latest_pid(component)
                                                  ├─ first(since, names, te)
                                                  └─ te_types()

The log is re-read on every call: it is small, and re-reading is robust to
rotation. Times in the log are ISO with milliseconds; `t` is epoch seconds,
comparable with the load's clock (stream.now).
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Callable

from deepserve.supervisor.health_log import read_events

HEALTH_LOG = "health.jsonl"
PID_EVENTS = frozenset({"started", "ready"})
TIME_SLACK_S = 0.002  # health log times are truncated to milliseconds


def event_time(event: dict) -> float:
    """An event's ISO time ("2025-01-01T12:00:00.123Z") as Unix epoch seconds."""
    return datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00")).timestamp()


def te_of(component: str) -> str:
    """"te0/worker0" -> "te0"; "te0" -> "te0"; "gateway" -> "gateway"."""
    return component.split("/", 1)[0]


class HealthEvents:
    """The node's health log (`<log_dir>/health.jsonl` and its rotated files),
    re-read on every call: small, and robust to rotation."""

    def __init__(self, log_dir: str | os.PathLike):
        self.log_dir = Path(log_dir)

    @property
    def path(self) -> Path:
        return self.log_dir / HEALTH_LOG

    def events(self, since: float | None = None) -> list[dict]:
        """Every event (oldest first; `t` added: epoch seconds), those at or
        after `since` (minus the log's millisecond truncation) if given."""
        files = sorted(self.log_dir.glob(HEALTH_LOG + ".*"),
                       key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
        files = [p for p in files if p.suffix[1:].isdigit()] + [self.path]
        out: list[dict] = []
        for path in files:
            try:
                for event in read_events(path, on_bad_line=lambda n, line: None):
                    try:
                        event["t"] = event_time(event)
                    except (KeyError, TypeError, ValueError):
                        continue
                    if since is None or event["t"] >= since - TIME_SLACK_S:
                        out.append(event)
            except FileNotFoundError:
                continue
        out.sort(key=lambda e: e["t"])  # stable: same-millisecond events keep file order
        return out

    def latest_pid(self, component: str) -> tuple[int, float] | None:
        """(pid, event time) of the component's latest "started"/"ready" event with a pid."""
        for event in reversed(self.events()):
            if (event.get("component") == component and event.get("event") in PID_EVENTS
                    and isinstance(event.get("pid"), int)):
                return event["pid"], event["t"]
        return None

    def first(self, since: float, events: frozenset[str] | set[str],
              te: str | None = None) -> dict | None:
        """The first event named in `events` at or after `since`, of TE `te`'s
        components when given ("te0", "te0/worker0", ...)."""
        return self.first_where(since, lambda event: event.get("event") in events and (
            te is None or te_of(str(event.get("component", ""))) == te))

    def first_where(self, since: float, match: Callable[[dict], bool]) -> dict | None:
        """The first event at or after `since` for which match(event) is true."""
        return next((event for event in self.events(since) if match(event)), None)

    def te_types(self) -> dict[str, str]:
        """te id -> te_type as far as the log's details say (key te_type or type)."""
        types: dict[str, str] = {}
        for event in self.events():
            details = event.get("details") or {}
            kind = details.get("te_type") or details.get("type")
            component = str(event.get("component", ""))
            if isinstance(kind, str) and component.startswith("te"):
                types[te_of(component)] = kind
        return types
