"""Tools for chat templates that know nothing of tools: said in plain messages.

A template like SmolLM2's only concatenates each message's role and
content: it would drop `tools`, an assistant's `tool_calls` and fail on a
None content. fallback_messages rewrites a conversation into messages any
such template renders, in the Hermes/Qwen format (so parsers.py's "hermes"
parser reads the answer):

    tools                   a system message listing them in <tools></tools>
                            (joined to the first system message if there is one)
    assistant tool_calls    its content, then one <tool_call> block per call
    role "tool"             role "user", "<tool_response>\\n...\\n</tool_response>";
                            consecutive tool messages share one user message

Every message comes out with a string content (None is "", a list of
content parts is its text parts joined).
"""

from __future__ import annotations

import json
import re

from deepserve.errors import InvalidRequestError

TOOLS_INSTRUCTION = (
    "# Tools\n\n"
    "You can call functions to help with the user's request. Their signatures "
    "are listed within <tools></tools> XML tags:\n")
CALL_INSTRUCTION = (
    "To call a function, write a JSON object with its name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>")

_TOOLS_WORD = re.compile(r"\btools\b")


def template_supports_tools(template: str | None) -> bool:
    """The template reads the `tools` variable (else it would ignore them)."""
    return bool(template) and _TOOLS_WORD.search(template) is not None


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as role/content messages (module doc); the input
    is not modified."""
    out: list[dict] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{text_of(message.get('content'))}\n</tool_response>"
            if i > 0 and messages[i - 1].get("role") == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            out.append({"role": "assistant", "content": _with_calls(message)})
        else:
            out.append({**message, "content": text_of(message.get("content"))})
    return _with_tools(out, tools) if tools else out


def tools_prompt(tools: list[dict]) -> str:
    """The system text that lists the tools and says how to call them."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"{TOOLS_INSTRUCTION}<tools>\n{lines}\n</tools>\n\n{CALL_INSTRUCTION}"


def text_of(content) -> str:
    """A message content as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type") == "text")
    raise InvalidRequestError("a message content must be a string or a list of parts",
                              "messages")


def _with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    prompt = tools_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        merged = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": merged}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _with_calls(message: dict) -> str:
    blocks = "\n".join(call_block(call) for call in message["tool_calls"])
    content = text_of(message.get("content"))
    return f"{content}\n{blocks}" if content else blocks


def call_block(call) -> str:
    """One call of an assistant's tool_calls as the hermes format writes it."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("each tool_calls entry needs function.name", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            text = json.dumps(json.loads(arguments), ensure_ascii=False)
        except ValueError:
            text = arguments  # not JSON: the model sees the text it wrote
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    name = json.dumps(function["name"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {text}}}\n</tool_call>'
