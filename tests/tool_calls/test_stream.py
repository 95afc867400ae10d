"""The stream parsers give what the whole-text parsers give, whatever the
chunking: split at every position, one character at a time, and random
1-5 character chunks (fixed seeds). Content outside calls streams before
the output ends; a tail that may start a marker waits."""

from __future__ import annotations

import json
import random
import re

import pytest

from deepserve.tool_calls.choice import call_from_named, calls_from_required
from deepserve.tool_calls.parsers import PARSERS
from deepserve.tool_calls.stream import NamedToolStream, RequiredToolStream, ToolStream
from tests.tool_calls.samples import ALL

CALL_ID = re.compile(r"call_[0-9a-f]{24}")
IDS = [f"{s[0]}-{i}" for i, s in enumerate(ALL)]


def run(stream, chunks: list[str]) -> list:
    events = []
    for chunk in chunks:
        events += stream.feed(chunk)
    return events + stream.finish()


def collect(events: list) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) the events add up to, checking that
    they are shaped as OpenAI streams them."""
    content, calls, ids = "", [], set()
    for event in events:
        if isinstance(event, str):
            assert event, "no empty content events"
            content += event
        elif "id" in event:
            assert event["index"] == len(calls) and event["type"] == "function"
            assert CALL_ID.fullmatch(event["id"]) and event["id"] not in ids
            assert event["function"]["arguments"] == ""
            ids.add(event["id"])
            calls.append([event["function"]["name"], ""])
        else:
            assert set(event) == {"index", "function"} and event["index"] == len(calls) - 1
            calls[-1][1] += event["function"]["arguments"]
    return content, [tuple(call) for call in calls]


def chunkings(text: str):
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    yield list(text)
    for seed in range(5):
        rng, chunks, at = random.Random(seed), [], 0
        while at < len(text):
            size = rng.randint(1, 5)
            chunks.append(text[at:at + size])
            at += size
        yield chunks


@pytest.mark.parametrize("parser, text, content, calls", ALL, ids=IDS)
def test_every_chunking_streams_what_parse_finds(parser, text, content, calls):
    whole_content, whole_calls = PARSERS[parser].parse(text)
    expected = (whole_content or "", [(c.name, c.arguments) for c in whole_calls])
    for chunks in chunkings(text):
        assert collect(run(ToolStream(parser), chunks)) == expected, chunks


def test_content_streams_as_it_comes_and_a_possible_tag_waits():
    stream = ToolStream("hermes")
    assert stream.feed("Let me ") == ["Let me"]  # the space waits for more content
    assert stream.feed("look <tool") == [" look"]
    assert stream.feed("box> for it") == [" <toolbox> for it"]
    assert stream.feed(" <tool_call>") == []
    assert stream.feed('{"name": "f", "arguments": {}}') == []
    events = stream.feed("</tool_call>")
    assert [e["index"] for e in events] == [0, 0] and events[1]["function"]["arguments"] == "{}"
    assert stream.feed("\n") == [] and stream.finish() == []


def test_mistral_calls_go_out_when_the_list_closes():
    stream = ToolStream("mistral")
    assert stream.feed('[TOOL_CALLS][{"name": "f", "arguments": {"s": "]"}}') == []
    events = stream.feed("]")
    assert events[0]["function"]["name"] == "f"
    assert events[1]["function"]["arguments"] == '{"s":"]"}'


def test_llama_decides_at_the_end():
    stream = ToolStream("llama3_json")
    assert stream.feed('{"name": "f", "parameters": {}}') == []
    assert [e["function"]["name"] for e in stream.finish() if "id" in e] == ["f"]
    stream = ToolStream("llama3_json")
    assert stream.feed("Plain text") == ["Plain text"]


ARRAY = ('[{"name": "get_weather", "parameters": {"city": "Par}is\\"", "n": [1, {"a": 2}]}},'
         ' {"name": "get_time", "parameters": {}}]')


def test_required_stream_matches_calls_from_required():
    expected = [(c.name, c.arguments) for c in calls_from_required(ARRAY)]
    assert expected == [("get_weather", '{"city":"Par}is\\"","n":[1,{"a":2}]}'),
                        ("get_time", "{}")]
    for chunks in chunkings(ARRAY):
        assert collect(run(RequiredToolStream(), chunks)) == ("", expected)


def test_required_stream_emits_each_call_when_its_object_closes():
    stream = RequiredToolStream()
    first = ARRAY.index("},") + 1
    events = stream.feed(ARRAY[:first])
    assert [e["function"]["name"] for e in events if "id" in e] == ["get_weather"]
    assert [e["index"] for e in stream.feed(ARRAY[first:])] == [1, 1]


def test_a_required_output_cut_short_keeps_its_complete_calls():
    cut = ARRAY[:-10]
    assert [c.name for c in calls_from_required(cut)] == ["get_weather"]
    assert collect(run(RequiredToolStream(), [cut]))[1] == [
        ("get_weather", '{"city":"Par}is\\"","n":[1,{"a":2}]}')]


def test_named_stream_streams_the_arguments():
    text = '{"city": "Paris"}'
    for chunks in chunkings(text):
        content, calls = collect(run(NamedToolStream("get_weather"), chunks))
        assert content == "" and calls == [("get_weather", text)]
        assert json.loads(calls[0][1]) == json.loads(call_from_named("get_weather", text).arguments)
    assert collect(run(NamedToolStream("f"), [])) == ("", [("f", "")])


PIECES = ["<tool_call>", "</tool_call>", "<tool", "[TOOL_CALLS]", "[TOOL", "[ARGS]", "[CALL_ID]x1",
          "<|python_tag|>", "<|py", '{"name": "f", "arguments": {"a": 1}}',
          '{"name": "g", "parameters": {}}', '[{"name": "h", "arguments": {}}]', "get_time",
          "{", "}", "[", "]", '"', "\\", ";", " ", "\n", "text", "é"]


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_random_outputs_stream_as_they_parse(parser):
    """Outputs glued from markers, their prefixes and JSON bits: the stream
    and parse() agree on each, in random chunks."""
    rng = random.Random(parser)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        content, calls = PARSERS[parser].parse(text)
        expected = (content or "", [(c.name, c.arguments) for c in calls])
        sizes = [rng.randint(1, 5) for _ in text]
        chunks, at = [], 0
        for size in sizes:
            chunks.append(text[at:at + size])
            at += size
        assert collect(run(ToolStream(parser), chunks)) == expected, text
