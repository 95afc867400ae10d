"""Tool calls of one streamed choice, as OpenAI streams them.

An event is either a str (a piece of content) or a dict (one entry of the
delta's tool_calls list):

    {"index": i, "id": "call_...", "type": "function",
     "function": {"name": N, "arguments": ""}}          first, once per call
    {"index": i, "function": {"arguments": "..."}}      then the arguments

ToolStream ("auto") runs the matchers of parsers.py on a growing buffer:

    outside ──marker found──> inside ──Match──> call events, outside
       │                        └──FAIL──> the marker is content, outside
       └─ content streams as it comes, but a tail that may begin a marker
          ("<tool", "[TOOL") is held until the next text settles it

A call is emitted once its matcher decides: its arguments come as one
fragment when the call is complete (after </tool_call>, after the closing
bracket of mistral's list or args), never character by character. A JSON
body that is invalid cannot be told from one not yet finished, so it holds
the rest of the output until finish(). llama3_json decides only at the end
(a plain JSON answer starts like a call): after "{" or <|python_tag|> the
rest is held until finish().

Content whitespace is streamed as parse() strips it: none before the first
content character, and whitespace is held until more content follows (so
trailing whitespace, and whitespace before a call, never goes out). The
concatenated content events are exactly parse()'s content ("" for None),
and the calls are parse()'s calls, whatever the chunking.

NamedToolStream and RequiredToolStream serve the grammar-constrained modes
of choice.py: the named output is the arguments, streamed as they come; the
required output is a JSON array whose items go out as each one completes.
"""

from __future__ import annotations

from deepserve.tool_calls.choice import ArrayItems, required_call
from deepserve.tool_calls.parsers import (FAIL, PARSERS, Match, ToolCall, ToolParser,
                                         new_call_id)

Event = str | dict


def call_events(index: int, call: ToolCall) -> list[dict]:
    """The two deltas of one complete call."""
    return [header_event(index, call.id, call.name),
            {"index": index, "function": {"arguments": call.arguments}}]


def header_event(index: int, call_id: str, name: str) -> dict:
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": ""}}


class _Content:
    """Content text with parse()'s strip applied as it streams."""

    def __init__(self):
        self._is_started = False
        self._pending = ""  # whitespace that goes out only if content follows

    def add(self, text: str, events: list[Event]) -> None:
        if not self._is_started:
            text = text.lstrip()
            if not text:
                return
            self._is_started = True
        text = self._pending + text
        kept = text.rstrip()
        self._pending = text[len(kept):]
        if kept:
            events.append(kept)


class ToolStream:
    """The "auto" parser of one choice: feed() each text delta, then finish()."""

    def __init__(self, parser: str | ToolParser):
        self._parser = PARSERS[parser] if isinstance(parser, str) else parser
        self._buffer = ""
        self._marker_len: int | None = None  # set while inside a call
        self._is_at_start = True  # no content character seen (bare_start may apply)
        self._content = _Content()
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final):
            pass
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """One move of the state machine; False when it must wait."""
        if self._marker_len is not None:
            return self._inside(events, final)
        if self._is_at_start:
            return self._start(final)
        return self._outside(events, final)

    def _start(self, final: bool) -> bool:
        """Whitespace first is no content; a bare_start opens a call."""
        stripped = self._buffer.lstrip()
        if not stripped and not final:
            return False
        self._is_at_start = False
        bare = self._parser.bare_start
        if bare and stripped.startswith(bare):
            self._buffer, self._marker_len = stripped, 0
        return True

    def _outside(self, events: list[Event], final: bool) -> bool:
        marker = self._parser.marker
        at = self._buffer.find(marker)
        if at >= 0:
            self._content.add(self._buffer[:at], events)
            self._buffer, self._marker_len = self._buffer[at:], len(marker)
            return True
        keep = 0 if final else _partial_tail(self._buffer, marker)
        self._content.add(self._buffer[:len(self._buffer) - keep], events)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _inside(self, events: list[Event], final: bool) -> bool:
        found = self._parser.match(self._buffer, self._marker_len, final)
        if isinstance(found, Match):
            for call in found.calls:
                events += call_events(self.num_calls, call)
                self.num_calls += 1
            self._buffer = self._buffer[found.end:]
        elif found is FAIL:
            self._content.add(self._buffer[:self._marker_len], events)
            self._buffer = self._buffer[self._marker_len:]
        else:
            return False
        self._marker_len = None
        return True


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper start of marker."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class NamedToolStream:
    """A named tool_choice: the whole output is the arguments of one call."""

    def __init__(self, name: str):
        self._name = name
        self._id = new_call_id()
        self._is_started = False
        self.num_calls = 1  # the call is there from the start

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = self._header()
        if text:
            events.append({"index": 0, "function": {"arguments": text}})
        return events

    def finish(self) -> list[Event]:
        return self._header()

    def _header(self) -> list[Event]:
        if self._is_started:
            return []
        self._is_started = True
        return [header_event(0, self._id, self._name)]


class RequiredToolStream:
    """tool_choice "required": each array item goes out as a call once its
    closing brace arrives (the same items calls_from_required reads)."""

    def __init__(self):
        self._items = ArrayItems()
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for item in self._items.feed(text):
            call = required_call(item)
            if call is not None:
                events += call_events(self.num_calls, call)
                self.num_calls += 1
        return events

    def finish(self) -> list[Event]:
        return []  # an item still open was cut short: no call
