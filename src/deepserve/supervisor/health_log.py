"""The node's health log: JSON lines, one event per line, for machines and
for `tail -f` / `bin/deepserve-health --follow`.

    {"time": "2025-01-01T12:00:00.123Z", "node": "n0", "component": "te0",
     "pid": 4242, "event": "crashed", "details": {"exit_code": -9}}

Invariants a reader can rely on:
- every line is written by one write() of the whole line (newline included)
  on an O_APPEND, unbuffered file, so a reader never sees half a line except
  a torn last line after a crash of the writer (read_events skips it);
- rotation happens between lines: health.jsonl -> .1 -> ... -> .<backups>,
  the oldest dropped; a line is never split across files;
- event names come from the closed list EVENTS; anything else is a bug in
  the caller and raises ValueError.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from deepserve.private_files import open_private_append

logger = logging.getLogger(__name__)

DEBUG, INFO, WARNING, ERROR = "debug", "info", "warning", "error"

SEVERITY: dict[str, str] = {
    "started": INFO,
    "ready": INFO,
    "heartbeat_missed": WARNING,
    "hung": ERROR,
    "crashed": ERROR,
    "oom": ERROR,
    "killed": WARNING,
    "restarting": WARNING,
    "recovered": INFO,
    "failed": ERROR,
    "evicted": WARNING,
    "request_migrated": WARNING,
    "te_list_complete": INFO,
    "te_removed": WARNING,
    "te_id_conflict": ERROR,
    "request_quarantined": ERROR,
    "fault_injected": WARNING,
    "scale_decision": INFO,
    "scaled_out": INFO,
    "scaled_in": INFO,
    "scale_failed": ERROR,
    "pool_ready": INFO,
    "pool_gave_up": ERROR,  # a node: its pre-warmed pods kept dying, none is started again
    "scale_unplaced": ERROR,  # the CM: no node has room for a scaled TE of a model
    "scale_refused": WARNING,  # a node: a ScaleOut beyond its free devices, or an unknown model
    "model_learned": INFO,  # a joined node: a model the head placed here, from its ScaleOut
    "node_joined": INFO,  # the CM: a node's first report (new, restarted, or back after lost)
    "node_lost": ERROR,
    "head_lost": ERROR,  # a standby head: the head's CM silent for failover_s
    "head_taken_over": WARNING,  # the standby started the CM and JE on its own host
    "head_stepped_down": ERROR,  # a head's CM heard a higher term: its CM and JE stop
    "weights_forked": INFO,  # a node pulled a model's files from a peer (fork)
    "fork_failed": ERROR,  # no peer gave them: the TEs waiting for it are refused
    "cache_block_corrupt": WARNING,
    "cache_tier_disabled": ERROR,
    "cache_tier_enabled": INFO,
    "peer_refused": WARNING,  # a tcp:// peer not on the allow-list ([cluster] secure)
    "peer_ignored": WARNING,  # a member's message about what is not its own (identity)
    "insecure": WARNING,  # a node started with sockets open beyond loopback ([cluster] insecure)
    "dualpath_decision": DEBUG,  # only from a job executor logging at DEBUG
}

EVENTS: frozenset[str] = frozenset(SEVERITY)

KEYS = ("time", "node", "component", "pid", "event", "details")

DEFAULT_MAX_BYTES = 10 * 1024 * 1024


def utc_now_iso() -> str:
    """ISO 8601 UTC with milliseconds, e.g. 2025-01-01T12:00:00.123Z."""
    stamp = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def check_event(event: str) -> None:
    if event not in EVENTS:
        raise ValueError(f"unknown health event {event!r}; known: {sorted(EVENTS)}")


def parse_line(line: str) -> dict:
    """One complete line -> event dict; ValueError if it is not a JSON object."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError("health log line is not a JSON object")
    return record


class HealthLog:
    """Appends events to `path`; safe to share between threads."""

    def __init__(self, path: str | os.PathLike, node: str,
                 max_bytes: int = DEFAULT_MAX_BYTES, backups: int = 3) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = os.fspath(path)
        self.node = node
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._file = None
        self._size = 0
        self._open()

    def write(self, component: str, event: str, pid: int | None = None,
              **details: Any) -> None:
        check_event(event)
        record = {"time": utc_now_iso(), "node": self.node, "component": component,
                  "pid": pid, "event": event, "details": details}
        # default=str: a stray non-JSON detail (a Path, an exception) must not
        # cost us the event.
        data = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._file is None:
                raise ValueError(f"health log {self.path} is closed")
            if self._size > 0 and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._write_all(data)
            self._size += len(data)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> HealthLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        # Unbuffered append: each write() goes straight to the kernel. Owner-only:
        # events name requests and tenants (private_files.py).
        self._file = open_private_append(self.path)
        self._size = os.fstat(self._file.fileno()).st_size

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # FileIO.write may in principle write short
            written = self._file.write(view)
            view = view[written:]

    def _rotate(self) -> None:
        """health.jsonl.(n-1) -> .n, ..., health.jsonl -> .1; called under the lock."""
        self._file.close()
        if self.backups == 0:
            os.remove(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._open()


def read_events(path: str | os.PathLike,
                on_bad_line: Callable[[int, str], None] | None = None) -> Iterator[dict]:
    """Events of one file in order. A torn last line (no newline: the writer
    died mid-line) is skipped silently; other unparsable lines are skipped and
    reported to `on_bad_line(lineno, line)` (default: a logger warning)."""
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith("\n"):
                return
            if not line.strip():
                continue
            try:
                yield parse_line(line)
            except ValueError:
                if on_bad_line is None:
                    logger.warning("%s:%d: skipping invalid health log line", path, lineno)
                else:
                    on_bad_line(lineno, line)
