"""fallback_messages: a conversation with tools, tool calls and tool
results, rendered by a template that only concatenates role and content
(SmolLM2's), in the format the hermes parser reads back."""

from __future__ import annotations

import copy
import json

import jinja2

from deepserve.tool_calls.parsers import PARSERS
from deepserve.tool_calls.render import fallback_messages, template_supports_tools

SMOL = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
QWEN_LIKE = "{%- if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL2 = {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
    {"role": "assistant", "content": "Paris 18C, Lyon 20C."},
    {"role": "user", "content": [{"type": "text", "text": "And "},
                                 {"type": "text", "text": "Nice?"}]},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": {"city": "Nice"}}}]},
    {"role": "tool", "tool_call_id": "c3", "content": "22C"},
]


def render(messages):
    return jinja2.Template(SMOL).render(messages=messages)


def test_the_conversation_renders_with_a_plain_template():
    before = copy.deepcopy(CONVERSATION)
    messages = fallback_messages(CONVERSATION, [WEATHER])
    assert CONVERSATION == before, "the input is not modified"
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert all(isinstance(m["content"], str) for m in messages)
    text = render(messages)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>") in text
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
            "<tool_response>\n20C\n</tool_response><|im_end|>") in text
    assert "<|im_start|>user\nAnd Nice?<|im_end|>" in text
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Nice"}}\n</tool_call><|im_end|>') in text


def test_the_rendered_calls_parse_back():
    assistant = fallback_messages(CONVERSATION, [WEATHER])[2]
    content, calls = PARSERS["hermes"].parse(assistant["content"])
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Lyon"}')]


def test_tools_join_the_first_system_message():
    messages = fallback_messages([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}], [WEATHER])
    assert len(messages) == 2 and messages[0]["role"] == "system"
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert render(messages).count("<|im_start|>system") == 1


def test_without_tools_only_the_history_changes():
    messages = fallback_messages([{"role": "user", "content": "Hi"}], None)
    assert messages == [{"role": "user", "content": "Hi"}]
    assert fallback_messages(CONVERSATION, [])[0]["role"] == "user"


def test_arguments_that_are_no_json_are_shown_as_written():
    messages = fallback_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "a=1"}}]}], None)
    assert messages[0]["content"] == '<tool_call>\n{"name": "f", "arguments": a=1}\n</tool_call>'


def test_template_supports_tools():
    assert template_supports_tools(QWEN_LIKE)
    assert not template_supports_tools(SMOL)
    assert not template_supports_tools(None)
    assert not template_supports_tools("{{ toolset }}")
