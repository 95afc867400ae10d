"""Tool calling at the gateway, over the fake backend's scripted outputs
("[script]TEXT"): "auto" reads Hermes calls out of free text, whole and
streamed as OpenAI streams them (index, id and name first, then arguments);
required and named choices become grammars on the wire; the history's calls
and tool results travel to the template; bad tools are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.conftest import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
         '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
         '</tool_call>')


def _ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"weather? [script]{script}"}]


def test_auto_reads_hermes_calls(stack):
    resp = stack.openai().chat.completions.create(model=MODEL, messages=_ask(CALLS),
                                                  tools=[WEATHER, TIME])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2


def test_auto_streams_calls_as_openai_does(stack):
    before = len(stack.backend.submits)
    chunks = list(stack.openai().chat.completions.create(
        model=MODEL, messages=_ask(CALLS), tools=[WEATHER, TIME], stream=True))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: id and name
                    assert d.index not in calls and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "args": ""}
                calls[d.index]["args"] += d.function.arguments or ""
    assert finish == "tool_calls" and content == "Let me check."
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    rid = stack.backend.submits[before].request_id  # streamed: the JE is told too
    assert stack.backend.wait_for(lambda: stack.backend.turns_pinned.count(rid) == 1)


def test_plain_text_with_tools_is_content(stack):
    before = len(stack.backend.submits)
    resp = stack.openai().chat.completions.create(model=MODEL, messages=_ask("Sunny."),
                                                  tools=[WEATHER])
    assert resp.choices[0].message.content == "Sunny."
    assert not resp.choices[0].message.tool_calls and resp.choices[0].finish_reason == "stop"
    rid = stack.backend.submits[before].request_id  # no call: no pin
    assert stack.backend.wait_for(lambda: rid in {t.request_id for t in stack.backend.turns_done})
    assert rid not in stack.backend.turns_pinned


def test_named_choice_sends_the_parameters_schema_and_reads_the_arguments(stack):
    before = len(stack.backend.submits)
    resp = stack.openai().chat.completions.create(
        model=MODEL, messages=_ask('{"city": "Oslo"}'), tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    structured = stack.backend.submits[before].sampling.structured
    assert structured.kind == "json"
    assert json.loads(structured.spec) == WEATHER["function"]["parameters"]
    [call] = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert resp.choices[0].message.content is None


def test_required_choice_reads_the_array(stack):
    before = len(stack.backend.submits)
    resp = stack.openai().chat.completions.create(
        model=MODEL, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        messages=_ask('[{"name": "get_time", "parameters": {"zone": "UTC"}}]'))
    schema = json.loads(stack.backend.submits[before].sampling.structured.spec)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    [call] = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                         {"zone": "UTC"})
    assert resp.choices[0].finish_reason == "tool_calls"
    # ended in a call: the JE is told, after the turn's TurnDone (turn_pins.py)
    rid = stack.backend.submits[before].request_id
    assert stack.backend.wait_for(lambda: rid in stack.backend.turns_pinned)
    assert rid in {t.request_id for t in stack.backend.turns_done}


def test_a_chat_that_fails_ends_its_turn_without_ids(stack):
    """The JE forgets its prompt now, not once MAX_PENDING others pushed it out."""
    before = len(stack.backend.submits)
    with pytest.raises(openai.BadRequestError):
        stack.openai().chat.completions.create(model=MODEL, messages=_ask("[invalid]"))
    rid = stack.backend.submits[before].request_id
    assert stack.backend.wait_for(lambda: rid in {t.request_id for t in stack.backend.turns_done})
    [done] = [t for t in stack.backend.turns_done if t.request_id == rid]
    assert done.output_ids is None


def test_history_calls_and_results_reach_the_job_executor(stack):
    before = len(stack.backend.submits)
    stack.openai().chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=2, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    submit = stack.backend.submits[before]
    assert submit.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert submit.messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    assert submit.chat.tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
])
def test_bad_tools_are_400s_naming_the_field(stack, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        stack.openai().chat.completions.create(model=MODEL, messages=_ask("x"), extra_body=extra)
    assert info.value.body["param"] == param


def test_integers_past_64_bits_in_tools_and_history_are_carried(stack):
    """JSON has no integer bound; the wire has: such values travel as floats
    (or their digits, past float's range), never a 400 or a dead request."""
    before = len(stack.backend.submits)
    big = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 10**30}}}}}
    stack.openai().chat.completions.create(
        model=MODEL, tools=[big], max_tokens=2, messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c", "type": "function",
                "function": {"name": "f", "arguments": json.dumps({"n": 10**400})}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}],
        extra_body={"chat_template_kwargs": {"huge": -(10**20)}})
    submit = stack.backend.submits[before]
    assert submit.chat.tools[0]["function"]["parameters"]["properties"]["n"]["maximum"] == 1e30
    assert submit.messages[1]["tool_calls"][0]["function"]["arguments"] == {"n": str(10**400)}
    assert submit.chat.template_kwargs == {"huge": -1e20}
