"""The bounds of a StructuredOutput, checked without compiling it.

A spec past MAX_SPEC_CHARS, a JSON schema nested deeper than
MAX_SCHEMA_DEPTH, or a choice list past MAX_CHOICES (or with an empty or
overlong choice) is an InvalidRequestError naming `structured_outputs`
(the gateway's 400, before anything queues). Whether a spec compiles is
compile.check's question (it needs xgrammar).
"""

from __future__ import annotations

import json
import re

from deepserve.errors import SpecError
from deepserve.messages.sampling import STRUCTURED_KINDS, StructuredOutput

MAX_SPEC_CHARS = 64 * 1024
"""Characters of one spec (schema, pattern, grammar, tag) at most."""
MAX_SCHEMA_DEPTH = 32
"""Nesting of a JSON schema (objects and lists, the outermost counts 1) at most."""
MAX_CHOICES = 256
"""Strings of one choice at most."""
MAX_CHOICE_CHARS = 1024
"""Characters of one choice at most."""
MAX_REPEATS = 10_000
"""Counted repetitions ({n}, {n,m}) of one spec, summed over their bounds,
at most: xgrammar unrolls them at compile time, so their sum is what a
compile costs (1.3 s for one [a-z]{1,100000} on a Zen 3 core; 4,000 of
those fit in a 64 KiB spec). Nested ones do not multiply (measured: 9 ms
for (a{0,100}){0,100})."""
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")

PARAM = "structured_outputs"


def check_limits(structured: StructuredOutput, param: str = PARAM) -> StructuredOutput:
    """Raise SpecError(param) for a spec past a bound; return it."""
    if structured.kind not in STRUCTURED_KINDS:
        raise SpecError(f"unknown structured output kind {structured.kind!r}", param)
    if len(structured.spec) > MAX_SPEC_CHARS:
        raise SpecError(f"the {structured.kind} spec has {len(structured.spec)} "
                                  f"characters; at most {MAX_SPEC_CHARS} are accepted", param)
    if (repeats := num_repeats(structured.spec)) > MAX_REPEATS:
        raise SpecError(f"the {structured.kind} spec repeats {repeats} times in "
                                  f"counted repetitions ({{n,m}}); at most {MAX_REPEATS} are "
                                  "accepted", param)
    if structured.kind in ("json", "structural_tag", "choice"):
        value = _parse(structured, param)
        depth = nesting(value)
        if depth > MAX_SCHEMA_DEPTH:
            raise SpecError(f"the {structured.kind} spec is nested {depth} deep; "
                                      f"at most {MAX_SCHEMA_DEPTH} is accepted", param)
        if structured.kind == "json" and not isinstance(value, (dict, bool)):
            raise SpecError("a JSON schema must be an object", param)
        if structured.kind == "choice":
            _check_choices(value, param)
    elif structured.kind in ("regex", "grammar") and not structured.spec:
        raise SpecError(f"the {structured.kind} spec is empty", param)
    return structured


def num_repeats(spec: str) -> int:
    """The sum of the bounds of every {n} / {n,m} / {n,} in the text (a
    JSON schema's "pattern" strings included: the text is scanned as is)."""
    total = 0
    for low, high in _REPEAT.findall(spec):
        bound = high or low
        if len(bound) > 9:
            return MAX_REPEATS + 1  # past any bound, without a huge int
        total += int(bound)
        if total > MAX_REPEATS:
            break
    return total


def nesting(value) -> int:
    """Depth of nested dicts and lists (a scalar is 0), without recursion:
    a hostile spec nested a million deep must not overflow the stack."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest  # enough to refuse it
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _parse(structured: StructuredOutput, param: str):
    try:
        return json.loads(structured.spec)
    except (ValueError, RecursionError) as e:
        raise SpecError(f"the {structured.kind} spec is not valid JSON: {e}",
                                  param) from e


def _check_choices(value, param: str) -> None:
    if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
        raise SpecError(f"choice must be a list of 1 to {MAX_CHOICES} strings", param)
    for choice in value:
        if not isinstance(choice, str) or not choice or len(choice) > MAX_CHOICE_CHARS:
            raise SpecError(
                f"each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters", param)
