"""tool_choice as a JSON schema: the schemas compile with xgrammar, an
output of the forced shape reads back as calls, and bad tools or choices
are refused naming the field."""

from __future__ import annotations

import json

import pytest

from deepserve.errors import InvalidRequestError
from deepserve.structured.compile import check
from deepserve.tool_calls.choice import call_from_named, calls_from_required, tool_grammar


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "description": f"the {name} function"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", {"type": "object",
                               "properties": {"city": {"type": "string"},
                                              "unit": {"enum": ["C", "F"]}},
                               "required": ["city"]})
NOW = tool("now")
ROUTE = tool("plan.route-v2", {"type": "object", "$defs": {"point": {
    "type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
    "required": ["lat", "lon"]}}, "properties": {"stops": {
        "type": "array", "items": {"$ref": "#/$defs/point"}}}, "required": ["stops"]})
TOOLS = [WEATHER, NOW, ROUTE]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_free_choices_need_no_grammar(choice):
    assert tool_grammar(TOOLS, choice, True) is None
    assert tool_grammar(None, choice, True) is None


def test_a_named_choice_is_its_parameters():
    grammar = tool_grammar(TOOLS, named("get_weather"), True)
    assert grammar.kind == "json"
    assert json.loads(grammar.spec) == WEATHER["function"]["parameters"]
    check(grammar)
    assert json.loads(tool_grammar(TOOLS, named("now"), True).spec) == {
        "type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls(parallel):
    grammar = tool_grammar(TOOLS, "required", parallel)
    schema = json.loads(grammar.spec)
    check(grammar)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == (None if parallel else 1)
    items = schema["items"]["anyOf"]
    assert [item["properties"]["name"] for item in items] == [
        {"type": "string", "enum": [t["function"]["name"]]} for t in TOOLS]
    assert all(item["required"] == ["name", "parameters"] for item in items)
    assert items[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "point" in schema["$defs"] and "$defs" not in items[2]["properties"]["parameters"]
    assert "$defs" in ROUTE["function"]["parameters"], "the request's tools are not modified"


SAMPLE = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}, '
          '{"name": "plan.route-v2", "parameters": {"stops": [{"lat": 1.5, "lon": 2}]}}]')


def accepts(grammar, text: str) -> bool:
    """xgrammar's own test helper (private: skip if a version lacks it)."""
    import xgrammar.testing
    from deepserve.structured.compile import grammar_of
    helper = getattr(xgrammar.testing, "_is_grammar_accept_string", None)
    if helper is None:
        pytest.skip("this xgrammar has no _is_grammar_accept_string")
    return helper(grammar_of(grammar), text)


def test_the_required_grammar_takes_the_shape_and_reads_back():
    grammar = tool_grammar(TOOLS, "required", True)
    assert accepts(grammar, SAMPLE)
    assert accepts(grammar, '[{"name": "now", "parameters": {}}]')
    assert not accepts(grammar, "[]")
    assert not accepts(grammar, '[{"name": "nope", "parameters": {}}]')
    assert not accepts(grammar, '[{"name": "get_weather", "parameters": {"unit": "C"}}]')
    assert not accepts(tool_grammar(TOOLS, "required", False), SAMPLE)
    calls = calls_from_required(SAMPLE)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("plan.route-v2", {"stops": [{"lat": 1.5, "lon": 2}]})]
    assert calls[0].arguments == '{"city":"Paris","unit":"C"}'


def test_the_named_grammar_takes_the_arguments_and_reads_back():
    grammar = tool_grammar(TOOLS, named("get_weather"), True)
    output = '{"city": "Paris", "unit": "F"}'
    assert accepts(grammar, output)
    assert not accepts(grammar, '{"unit": "F"}')
    assert not accepts(grammar, '{"city": "Paris", "extra": 1}')
    call = call_from_named("get_weather", output)
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris","unit":"F"}')


def test_a_named_output_reads_back():
    call = call_from_named("get_weather", '{ "city": "Paris" }')
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris"}')
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call_from_named("f", '{"cut": "sh').arguments == '{"cut": "sh'


@pytest.mark.parametrize("tools, choice, param", [
    (TOOLS, named("missing"), "tool_choice"),
    ([], "required", "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    ([WEATHER, WEATHER], "auto", "tools"),
    ([tool("")], "auto", "tools"),
    ([tool("x" * 65)], "auto", "tools"),
    ([tool("has space")], "auto", "tools"),
    ([tool("f", [])], "auto", "tools"),
    ([{"type": "retrieval"}], "auto", "tools"),
    ({"get_weather": WEATHER}, "auto", "tools"),
    ([tool("a", {"$defs": {"p": {"type": "string"}}}),
      tool("b", {"$defs": {"p": {"type": "number"}}})], "required", "tools"),
])
def test_bad_tools_and_choices_are_refused(tools, choice, param):
    with pytest.raises(InvalidRequestError) as raised:
        tool_grammar(tools, choice, True)
    assert raised.value.param == param


def test_a_64_character_name_is_fine():
    name = "a" * 64
    assert json.loads(tool_grammar([tool(name)], named(name), False).spec)["type"] == "object"
