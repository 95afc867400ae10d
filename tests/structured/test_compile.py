"""Specs compile with xgrammar, or are refused with its reason (no C++
source location in the message); the vocabulary comes from tokenizer.json."""

from __future__ import annotations

import json

import pytest

from deepserve.errors import InvalidRequestError
from deepserve.messages.sampling import StructuredOutput
from deepserve.structured.compile import GrammarCompiler, check

GOOD = [
    StructuredOutput(kind="json", spec=json.dumps(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})),
    StructuredOutput(kind="json_object"),
    StructuredOutput(kind="regex", spec=r"\d{3}-[a-z]+"),
    StructuredOutput(kind="choice", spec=json.dumps(["yes", "no", 'a "quoted" \\ one'])),
    StructuredOutput(kind="grammar", spec='root ::= "a" | "b" root'),
    StructuredOutput(kind="structural_tag", spec=json.dumps(
        {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
         "triggers": ["<f>"]})),
]


@pytest.mark.parametrize("structured", GOOD, ids=lambda s: s.kind)
def test_good_specs_compile(structured, tiny_model):
    check(structured)
    compiled = GrammarCompiler(tiny_model, 2048, [0]).compile(structured)
    assert compiled.memory_size_bytes > 0


@pytest.mark.parametrize("structured, words", [
    (StructuredOutput(kind="json", spec='{"type": "nope"}'), "nope"),
    (StructuredOutput(kind="regex", spec="(?<=a)b"), "Lookbehind"),
    (StructuredOutput(kind="grammar", spec="root ::= "), "EBNF"),
    (StructuredOutput(kind="grammar", spec='start ::= "a"'), "root"),
])
def test_bad_specs_are_refused_with_the_reason(structured, words):
    with pytest.raises(InvalidRequestError) as info:
        check(structured, "response_format")
    assert info.value.param == "response_format"
    assert words in str(info.value) and ".cc:" not in str(info.value)


def test_while_beating_beats_until_the_work_ends_and_passes_its_error():
    import time

    from deepserve.structured.compile import BEAT_S, while_beating
    beats: list[float] = []
    assert while_beating(lambda: time.sleep(4 * BEAT_S) or "done",
                         lambda: beats.append(time.monotonic())) == "done"
    assert len(beats) >= 3  # the caller kept beating while the work ran

    def fails():
        raise ValueError("bad vocabulary")
    with pytest.raises(ValueError, match="bad vocabulary"):
        while_beating(fails, lambda: None)
