"""Step timeline: where a TE step's wall time goes, process by process, and
where one token goes from the worker's forward to the client's socket.

Off unless the TE's config names a folder (EngineConfig.timeline_dir;
tools/profile_step.py --engine sets it) or the environment does
($DEEPSERVE_TIMELINE, inherited by every process of a node:
tools/token_trip.py sets it). Then each process keeps its spans in memory —
(part, step id, start, end, size, key), time.monotonic(), one clock for
every process of the node; size is what the span worked on (the forward's
tokens), key names one token of one request ("REQUEST_ID#N": its Nth output
token) where the span is about one — and writes them on close to
FOLDER/COMPONENT-PID.jsonl, one JSON list per line:

    master     schedule · ring_write · collect (StepDone received -> streamed)
    worker     ring_read · prepare · forward · sample · step_done (rank 0's send)
    tokenizer  detokenize · reply (one StepTokens message: text, then deltas out)
               reply_item (one request's delta: keyed, with its step id)
    gateway    sse (keyed: the HTTP writer has the delta -> its event is written)

Off, a span costs one attribute test; the recorders never raise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_SPANS = 1_000_000  # a bound, not a target: a long run keeps its first spans
ENV = "DEEPSERVE_TIMELINE"
Span = tuple[str, int, float, float, int, str]


def token_key(request_id: str, num_tokens: int) -> str:
    """The key of a request's num_tokens-th output token (1 is the first)."""
    return f"{request_id}#{num_tokens}"


class Timeline:
    def __init__(self, component: str, folder: str | None = None):
        folder = folder or os.environ.get(ENV) or None
        self.on = bool(folder)
        self.folder = Path(folder) if folder else None
        self.component = component.replace("/", "-")
        self.spans: list[Span] = []

    def add(self, part: str, step_id: int, start: float, end: float, size: int = 0,
            key: str = "") -> None:
        """size: what the span worked on (tokens of a forward, items of a message);
        key: the token it is about (token_key), if one."""
        if self.on and len(self.spans) < MAX_SPANS:
            self.spans.append((part, step_id, start, end, size, key))

    def close(self) -> Path | None:
        """Write the spans (once); the file's path, or None when off or empty."""
        if not self.on or not self.spans:
            return None
        path = self.folder / f"{self.component}-{os.getpid()}.jsonl"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                for span in self.spans:
                    f.write(json.dumps(span) + "\n")
        except OSError:
            return None
        self.spans = []
        return path


def read_spans(folder: Path) -> dict[str, list[Span]]:
    """component (the file name less its pid) -> its spans, from every file."""
    out: dict[str, list] = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        component = path.stem.rsplit("-", 1)[0]
        with open(path) as f:
            out.setdefault(component, []).extend(tuple(json.loads(line)) for line in f)
    return out
