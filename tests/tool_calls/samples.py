"""Model outputs for every parser, shared by the parse and stream tests:
(parser, text, content, [(name, arguments), ...]) with what parse() answers."""

from __future__ import annotations

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
W_ARGS = '{"city":"Paris","unit":"C"}'
T_ARGS = '{"tz":"Europe/Paris"}'
BRACES = '{"note":"a } and a \\" and <tool_call> in a string"}'

HERMES = [
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", W_ARGS)]),
    ("hermes", f"Let me look.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>\n',
     "Let me look.", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("hermes", "<tool_call>{bad json}</tool_call> then text",
     "<tool_call>{bad json}</tool_call> then text", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("hermes", "   ", None, []),
    ("hermes", "a <tool_cal b < c <tool_call", "a <tool_cal b < c <tool_call", []),
    ("hermes", f"<tool_call>\n{W}", None, [("get_weather", W_ARGS)]),  # left unclosed
    ("hermes", '<tool_call>{"name": "get_weather", "argum',
     '<tool_call>{"name": "get_weather", "argum', []),
    ("hermes", f'Hi <tool_call>{{"name": "note", "arguments": {BRACES}}}</tool_call> bye',
     "Hi  bye", [("note", BRACES)]),
    ("hermes", f"x<tool_call>oops<tool_call>{W}</tool_call>y",
     "x<tool_call>oopsy", [("get_weather", W_ARGS)]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     None, [("f", '{"a":1}')]),
]

LLAMA = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
     None, [("get_weather", W_ARGS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "C"}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
     None, [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("llama3_json", ' \n{"name": "a", "parameters": {}};{"name": "b", "parameters": {"x": [1]}}\n',
     None, [("a", "{}"), ("b", '{"x":[1]}')]),
    ("llama3_json", 'Calling now.<|python_tag|>{"name": "a", "parameters": {}}',
     "Calling now.", [("a", "{}")]),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", '{"name": "a", "parameters": {}} and more',
     '{"name": "a", "parameters": {}} and more', []),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": ',
     '{"name": "a", "parameters": {}}; {"name":', []),
    ("llama3_json", "<|python_tag|>not json", "<|python_tag|>not json", []),
    ("llama3_json", "It is sunny {mostly}.", "It is sunny {mostly}.", []),
    ("llama3_json", "Hello!", "Hello!", []),
]

MISTRAL = [
    ("mistral",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]',
     None, [("get_weather", W_ARGS)]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "C"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
     "Sure.", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}'
     '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
     None, [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS] {"tz": "Europe/Paris"}',
     None, [("get_time", T_ARGS)]),
    ("mistral", f'[TOOL_CALLS]note[ARGS]{BRACES} done', "done", [("note", BRACES)]),
    ("mistral", '[TOOL_CALLS][{"name": get_weather}]', '[TOOL_CALLS][{"name": get_weather}]', []),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', []),
    ("mistral", "[TOOL_CALLS] I cannot call that.", "[TOOL_CALLS] I cannot call that.", []),
    ("mistral", "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", []),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ', '[TOOL_CALLS]f[ARGS]{"a":', []),
    ("mistral", "Plain answer [TOOL", "Plain answer [TOOL", []),
    ("mistral", "No tools needed.", "No tools needed.", []),
]

ALL = HERMES + LLAMA + MISTRAL
