"""Tool calls found in free text ("auto"): one parser per model family's format.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen)
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}  (Llama 3.x)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]      (Mistral, list form)
                 [TOOL_CALLS]name[ARGS]{...}                               (newer tokenizers)

Every format is a *marker* (the text a call starts with) and a *matcher*
that reads the call from just after the marker: `match(text, start, final)`
answers MORE (the text so far cannot decide: wait), FAIL (this is no call)
or a Match (the calls and where they end). A matcher never looks behind
`start` and its verdict on a prefix never changes when text is appended;
that is what lets stream.py run the very same matchers on a growing buffer
and get the same answer as `parse` does on the whole text.

A failed call is never an error: its marker stays in the content as text and
scanning resumes right after the marker, so a malformed call (bad JSON, no
name) reaches the client as the text the model wrote. Content is the text
outside calls, stripped, None when nothing is left (as the OpenAI API
answers an assistant message that only calls tools).

The markers of llama3_json and mistral are special tokens: they reach the
text only when the request decodes with skip_special_tokens=False. A Llama
answer that starts with "{" needs no marker (the model often omits it).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Callable, NamedTuple

import msgspec

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
"""The characters of a function name (OpenAI's, plus the dot vLLM allows)."""

_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    """A tool call id as OpenAI spells them: call_ + 24 hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCall(msgspec.Struct, kw_only=True, frozen=True):
    """One call the model made. arguments: the JSON text of the arguments
    object, re-serialized compactly when it parses, else as the model wrote it."""

    name: str
    arguments: str
    id: str = msgspec.field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        """The entry of an assistant message's tool_calls list."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Undecided(Enum):
    MORE = "more"  # the text so far cannot decide; ask again with more text
    FAIL = "fail"  # no call here: the marker is content


MORE, FAIL = Undecided.MORE, Undecided.FAIL


class Match(NamedTuple):
    calls: list[ToolCall]
    end: int  # index just past the last character the calls took


Matcher = Callable[[str, int, bool], "Match | Undecided"]


def compact_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def arguments_text(value) -> str | None:
    """The arguments of a call as JSON text; None when they cannot be
    arguments (a number, a list). A string is JSON text the model wrote."""
    if isinstance(value, dict):
        return compact_json(value)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return compact_json(parsed) if isinstance(parsed, dict) else value
    return None


def call_of(obj, args_keys: tuple[str, ...] = ("arguments",),
            args_required: bool = False) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., <args key>: ...} object, or
    None when it is not one (no name, arguments of the wrong type)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        return None if args_required else ToolCall(name=name, arguments="{}")
    arguments = arguments_text(obj[key])
    return None if arguments is None else ToolCall(name=name, arguments=arguments)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _decode_at(text: str, pos: int, final: bool):
    """(value, end) of the JSON value at pos, MORE while it may still be
    completed, FAIL when it cannot be. Used only where the value starts with
    "[" or "{", whose end is its closing bracket: a prefix that decodes
    decodes to the same value and end in any longer text."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return FAIL if final else MORE


# -- hermes -----------------------------------------------------------------
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def match_hermes(text: str, start: int, final: bool) -> Match | Undecided:
    """The body runs to the first </tool_call>; a last block the output left
    unclosed counts when its body is a whole call."""
    close = text.find(HERMES_CLOSE, start)
    if close < 0 and not final:
        return MORE
    body, end = (text[start:], len(text)) if close < 0 else \
        (text[start:close], close + len(HERMES_CLOSE))
    try:
        call = call_of(json.loads(body))
    except ValueError:
        return FAIL
    return FAIL if call is None else Match([call], end)


# -- llama3_json ------------------------------------------------------------
LLAMA_TAG = "<|python_tag|>"


def match_llama(text: str, start: int, final: bool) -> Match | Undecided:
    """The rest of the output is calls separated by ";", or it is no call at
    all (a Llama tool answer is the whole output). Decided only at the end:
    a plain JSON answer starts like a call."""
    if not final:
        return MORE
    calls, pos = [], _skip_space(text, start)
    while True:
        if not text.startswith("{", pos):
            return FAIL
        decoded = _decode_at(text, pos, final=True)
        if decoded is FAIL:
            return FAIL
        obj, pos = decoded
        call = call_of(obj, ("parameters", "arguments"), args_required=True)
        if call is None:
            return FAIL
        calls.append(call)
        pos = _skip_space(text, pos)
        if pos == len(text):
            return Match(calls, pos)
        if text[pos] != ";":
            return FAIL
        pos = _skip_space(text, pos + 1)


# -- mistral ----------------------------------------------------------------
MISTRAL_MARKER, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def match_mistral(text: str, start: int, final: bool) -> Match | Undecided:
    """A JSON list of calls, or one name[ARGS]{...} call (each call of the
    newer form has a marker of its own)."""
    pos = _skip_space(text, start)
    if pos == len(text):
        return FAIL if final else MORE
    if text.startswith(MISTRAL_ARGS, pos):
        return FAIL  # arguments without a name
    if not final and _is_partial(text, pos, MISTRAL_ARGS):
        return MORE  # "[" may open the list or be a nameless "[ARGS]"
    if text[pos] == "[":
        return _mistral_list(text, pos, final)
    return _mistral_named(text, pos, final)


def _mistral_list(text: str, pos: int, final: bool) -> Match | Undecided:
    decoded = _decode_at(text, pos, final)
    if isinstance(decoded, Undecided):
        return decoded
    items, end = decoded
    if not isinstance(items, list) or not items:
        return FAIL
    calls = [call_of(item) for item in items]
    return FAIL if None in calls else Match(calls, end)


def _mistral_named(text: str, pos: int, final: bool) -> Match | Undecided:
    name_match = NAME_PATTERN.match(text, pos)
    if name_match is None:
        return FAIL
    name, pos = name_match.group(), name_match.end()
    if _may_be(text, pos, MISTRAL_CALL_ID, final):
        pos = _after_call_id(text, pos, final)
        if isinstance(pos, Undecided):
            return pos
    if not text.startswith(MISTRAL_ARGS, pos):
        return MORE if _is_partial(text, pos, MISTRAL_ARGS) and not final else FAIL
    pos = _skip_space(text, pos + len(MISTRAL_ARGS))
    if pos == len(text) or not text.startswith("{", pos):
        return MORE if pos == len(text) and not final else FAIL
    decoded = _decode_at(text, pos, final)
    if isinstance(decoded, Undecided):
        return decoded
    return Match([ToolCall(name=name, arguments=compact_json(decoded[0]))], decoded[1])


def _after_call_id(text: str, pos: int, final: bool) -> int | Undecided:
    """Skip [CALL_ID]<id> (some tokenizers put the id before [ARGS])."""
    if not text.startswith(MISTRAL_CALL_ID, pos):
        return MORE  # _may_be said it is a partial marker
    id_end = pos + len(MISTRAL_CALL_ID)
    while id_end < len(text) and text[id_end].isalnum():
        id_end += 1
    return MORE if id_end == len(text) and not final else id_end


def _may_be(text: str, pos: int, marker: str, final: bool) -> bool:
    """text at pos is marker, or (while more may come) a start of it."""
    return text.startswith(marker, pos) or (not final and _is_partial(text, pos, marker))


def _is_partial(text: str, pos: int, marker: str) -> bool:
    rest = text[pos:]
    return len(rest) < len(marker) and marker.startswith(rest)


# -- the scan ---------------------------------------------------------------
@dataclass(frozen=True)
class ToolParser:
    """One format: the marker a call starts with, its matcher, and the
    first character that starts calls without a marker (llama3_json's "{")."""

    name: str
    marker: str
    match: Matcher
    bare_start: str | None = None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; never raises."""
        content, calls, pos = [], [], 0
        stripped = text.lstrip()
        if self.bare_start and stripped.startswith(self.bare_start):
            pos = len(text) - len(stripped)  # the whitespace before is stripped anyway
            found = self.match(text, pos, True)
            if isinstance(found, Match):
                calls, pos = list(found.calls), found.end
        while (at := text.find(self.marker, pos)) >= 0:
            content.append(text[pos:at])
            pos = at + len(self.marker)
            found = self.match(text, pos, True)
            if isinstance(found, Match):
                calls += found.calls
                pos = found.end
            else:
                content.append(self.marker)
        content.append(text[pos:])
        return "".join(content).strip() or None, calls


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", HERMES_OPEN, match_hermes),
    "llama3_json": ToolParser("llama3_json", LLAMA_TAG, match_llama, bare_start="{"),
    "mistral": ToolParser("mistral", MISTRAL_MARKER, match_mistral),
}


def detect_parser(chat_template: str | None) -> str:
    """The format a model's chat template teaches it; hermes when the
    template tells nothing (render.py's fallback teaches hermes)."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_MARKER in template:
        return "mistral"
    if LLAMA_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"
