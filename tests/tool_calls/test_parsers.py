"""Each parser on well-formed, several-call, malformed and call-free output
(tests/tool_calls/samples.py), and the parser a chat template picks."""

from __future__ import annotations

import re

import pytest

from deepserve.tool_calls.parsers import PARSERS, ToolCall, detect_parser
from tests.tool_calls.samples import ALL

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@pytest.mark.parametrize("parser, text, content, calls", ALL,
                         ids=[f"{s[0]}-{i}" for i, s in enumerate(ALL)])
def test_parse(parser, text, content, calls):
    got_content, got_calls = PARSERS[parser].parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(CALL_ID.fullmatch(c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def test_the_call_is_openai_shaped():
    call = ToolCall(name="f", arguments='{"a":1}', id="call_" + "0" * 24)
    assert call.to_openai() == {"id": "call_" + "0" * 24, "type": "function",
                                "function": {"name": "f", "arguments": '{"a":1}'}}


def test_non_ascii_arguments_stay_readable():
    _, calls = PARSERS["hermes"].parse(
        '<tool_call>{"name": "say", "arguments": {"text": "h\\u00e9llo 日本"}}</tool_call>')
    assert calls[0].arguments == '{"text":"héllo 日本"}'


def test_a_string_that_is_no_json_is_kept_as_written():
    _, calls = PARSERS["mistral"].parse('[TOOL_CALLS][{"name": "f", "arguments": "a=1"}]')
    assert calls[0].arguments == "a=1"


@pytest.mark.parametrize("template, parser", [
    ("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}", "hermes"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% for message in messages %}{{ message['content'] }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_detect_parser(template, parser):
    assert detect_parser(template) == parser
