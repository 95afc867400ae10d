"""`bin/deepserve-health [PATH] [--follow] [--component C]... [--event E]...`:
the health log for a person, one line per event:

    12:00:00.123  te0[4242]  crashed  exit_code=-9 signal=SIGKILL

coloured by severity when stdout is a terminal. --follow works like `tail -f`
and survives rotation: when the path names a new file (inode changed) or the
file shrank, the old file is drained and the path reopened from its start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import datetime, timezone
from typing import Callable, Iterable

import click

from deepserve.supervisor.health_log import EVENTS, SEVERITY, parse_line, read_events

POLL_S = 0.2
ENV_PATH = "DEEPSERVE_HEALTH_LOG"
COLORS = {"debug": "\x1b[2m", "info": "\x1b[32m", "warning": "\x1b[33m", "error": "\x1b[31m"}
RESET = "\x1b[0m"


def format_event(record: dict, color: bool = False) -> str:
    clock = _clock(record.get("time"))
    component = str(record.get("component", "?"))
    pid = record.get("pid")
    who = f"{component}[{pid}]" if pid is not None else component
    event = str(record.get("event", "?"))
    details = record.get("details") or {}
    if not isinstance(details, dict):
        details = {"details": details}
    pairs = " ".join(f"{k}={_value(v)}" for k, v in details.items())
    line = f"{clock}  {who}  {event}" + (f"  {pairs}" if pairs else "")
    if color:
        # An event from a newer writer has no severity here: show it plainly.
        start = COLORS.get(SEVERITY.get(event, ""), "")
        if start:
            line = f"{start}{line}{RESET}"
    return line


def _clock(stamp: object) -> str:
    try:
        moment = datetime.fromisoformat(str(stamp)).astimezone(timezone.utc)
    except ValueError:
        return str(stamp)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def _value(value: object) -> str:
    if isinstance(value, str) and value and not any(c in value for c in ' ="\n\t'):
        return value
    return json.dumps(value, default=str)


def _warn_bad(path: str) -> Callable[[int, str], None]:
    def warn(lineno: int, line: str) -> None:
        print(f"deepserve-health: {path}:{lineno}: skipping invalid line: "
              f"{line.strip()[:80]!r}", file=sys.stderr, flush=True)
    return warn


def _follow(path: str, on_line: Callable[[str], None], poll_s: float = POLL_S) -> None:
    """Feed each complete line of `path` to on_line, forever."""
    f = None
    buf = b""

    def drain() -> None:
        nonlocal buf
        buf += f.read()
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            on_line(raw.decode("utf-8", errors="replace"))

    while True:
        if f is None:
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                time.sleep(poll_s)
                continue
            buf = b""
        drain()
        if _is_replaced(path, f):
            drain()  # lines written to the old file just before rotation
            f.close()
            f, buf = None, b""
            continue
        time.sleep(poll_s)


def _is_replaced(path: str, f) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return True
    return st.st_ino != os.fstat(f.fileno()).st_ino or st.st_size < f.tell()


class _Printer:
    def __init__(self, path: str, components: Iterable[str], events: Iterable[str],
                 color: bool) -> None:
        self.components = set(components)
        self.events = set(events)
        self.color = color
        self.warn = _warn_bad(path)
        self.num_lines = 0

    def record(self, record: dict) -> None:
        if self.components and record.get("component") not in self.components:
            return
        if self.events and record.get("event") not in self.events:
            return
        sys.stdout.write(format_event(record, self.color) + "\n")
        sys.stdout.flush()

    def line(self, line: str) -> None:
        self.num_lines += 1
        if not line.strip():
            return
        try:
            self.record(parse_line(line))
        except ValueError:
            self.warn(self.num_lines, line)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events (like tail -f).")
@click.option("--component", "-c", "components", multiple=True, help="Only this component (repeatable).")
@click.option("--event", "-e", "events", multiple=True, type=click.Choice(sorted(EVENTS)),
              help="Only this event (repeatable).")
@click.option("--no-color", is_flag=True, help="No ANSI colours.")
def main(path: str | None, follow: bool, components: tuple[str, ...],
         events: tuple[str, ...], no_color: bool) -> None:
    """Print the node's health log (PATH, default $DEEPSERVE_HEALTH_LOG or ./health.jsonl)."""
    path = path or os.environ.get(ENV_PATH) or "health.jsonl"
    # Ctrl-C ends --follow even when started from a background job, whose
    # SIGINT arrives ignored (Python then installs no handler of its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    color = not no_color and sys.stdout.isatty()
    printer = _Printer(path, components, events, color)
    try:
        if follow:
            _follow(path, printer.line)
        if not os.path.exists(path):
            raise click.ClickException(f"no health log at {path}")
        for record in read_events(path, on_bad_line=printer.warn):
            printer.record(record)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `deepserve-health | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    main(prog_name="deepserve-health")
