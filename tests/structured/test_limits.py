"""Every bound of a StructuredOutput at its boundary: the last value that
passes and the first that is refused (an InvalidRequestError naming the
field), without compiling anything."""

from __future__ import annotations

import json

import pytest

from deepserve.errors import InvalidRequestError
from deepserve.messages.sampling import StructuredOutput
from deepserve.structured.limits import (MAX_CHOICE_CHARS, MAX_CHOICES, MAX_REPEATS,
                                         MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, check_limits,
                                         nesting)


def _refused(structured: StructuredOutput, param: str = "structured_outputs") -> str:
    with pytest.raises(InvalidRequestError) as info:
        check_limits(structured, param)
    assert info.value.param == param
    return str(info.value)


def _nested_schema(depth: int) -> dict:
    """A schema whose JSON nests `depth` deep (the outermost object is 1)."""
    # each wrap adds 2 (an object, its properties); the base's parity decides
    schema: dict = {"type": "string"} if depth % 2 else {"enum": ["a"]}
    while nesting(schema) < depth:
        schema = {"type": "object", "properties": {"a": schema}}
    assert nesting(schema) == depth
    return schema


def test_spec_size_boundary():
    check_limits(StructuredOutput(kind="regex", spec="a" * MAX_SPEC_CHARS))
    message = _refused(StructuredOutput(kind="regex", spec="a" * (MAX_SPEC_CHARS + 1)))
    assert str(MAX_SPEC_CHARS) in message


def test_schema_depth_boundary():
    for depth in (MAX_SCHEMA_DEPTH - 1, MAX_SCHEMA_DEPTH):
        check_limits(StructuredOutput(kind="json", spec=json.dumps(_nested_schema(depth))))
    assert "nested" in _refused(StructuredOutput(
        kind="json", spec=json.dumps(_nested_schema(MAX_SCHEMA_DEPTH + 1))), "response_format")


def test_deep_json_does_not_overflow():
    """A hostile spec nested far past Python's recursion limit is refused."""
    _refused(StructuredOutput(kind="json", spec="[" * 50_000 + "]" * 50_000))
    _refused(StructuredOutput(kind="json", spec='{"a":' * 30_000 + "1" + "}" * 30_000))


def test_choice_bounds():
    check_limits(StructuredOutput(kind="choice", spec=json.dumps(["x"] * MAX_CHOICES)))
    _refused(StructuredOutput(kind="choice", spec=json.dumps(["x"] * (MAX_CHOICES + 1))))
    check_limits(StructuredOutput(kind="choice", spec=json.dumps(["x" * MAX_CHOICE_CHARS])))
    _refused(StructuredOutput(kind="choice", spec=json.dumps(["x" * (MAX_CHOICE_CHARS + 1)])))
    for bad in ([], [""], [1], "yes", {"a": 1}):
        _refused(StructuredOutput(kind="choice", spec=json.dumps(bad)))


@pytest.mark.parametrize("structured", [
    StructuredOutput(kind="json", spec="{not json"),
    StructuredOutput(kind="json", spec="[1, 2]"),
    StructuredOutput(kind="regex", spec=""),
    StructuredOutput(kind="grammar", spec=""),
    StructuredOutput(kind="nope", spec="x"),
])
def test_malformed_specs(structured):
    _refused(structured)


@pytest.mark.parametrize("make", [
    lambda n: StructuredOutput(kind="regex", spec=f"[a-z]{{1,{n}}}"),
    lambda n: StructuredOutput(kind="regex", spec=f"a{{{n // 2}}}b{{0,{n - n // 2}}}"),
    lambda n: StructuredOutput(kind="grammar", spec=f"root ::= [a-z]{{{n},}}"),
    lambda n: StructuredOutput(kind="json", spec=json.dumps(
        {"type": "string", "pattern": f"x{{1,{n}}}"})),
])
def test_counted_repetitions_boundary(make):
    """A hostile regex of many big counted repetitions would compile for
    hours: their summed bounds are capped."""
    check_limits(make(MAX_REPEATS))
    assert "repeats" in _refused(make(MAX_REPEATS + 1))


def test_a_huge_repetition_count_is_refused_without_parsing_it():
    _refused(StructuredOutput(kind="regex", spec="a{" + "9" * 5000 + "}"))
