"""Tool calling on /v1/chat/completions: the request's tools and history
rendered for the model, tool_choice enforced, and the output turned into
OpenAI's tool_calls (whole, or streamed as OpenAI streams them).

    tool_choice         grammar (tool_calls/choice.py)   output read by     finish_reason
    none                none; tools not rendered         —                  as generated
    auto (default with  none                             the model's        tool_calls when
      tools)                                             parser             a call is found
    required            [{name, parameters}, ...]        the array          tool_calls
    {function: {name}}  that function's parameters       the arguments      stop (as vLLM)

Rendering: a chat template that renders tools (it names `tools`) gets them
with the messages, assistant tool_calls (arguments as objects, as
transformers' templates expect) and tool messages as they are. One that
does not (SmolLM2's) gets messages every template can render
(tool_calls/render.py: a system prompt listing the tools in the Hermes
format, calls and results as text), and its output is read with the Hermes
parser. The parser is otherwise detected from the template
(tool_calls/parsers.detect_parser); formats whose markers are special tokens
(mistral, llama3_json) are detokenized with special tokens kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from deepserve.errors import SpecError
from deepserve.messages.engine import ChatOptions
from deepserve.messages.sampling import StructuredOutput
from deepserve.tool_calls.choice import (call_from_named, calls_from_required, named_choice,
                                         tool_grammar)
from deepserve.tool_calls.parsers import PARSERS, detect_parser
from deepserve.tool_calls.render import fallback_messages, template_supports_tools
from deepserve.tool_calls.stream import NamedToolStream, RequiredToolStream, ToolStream

MAX_TOOLS = 128
"""Tools of one request at most (OpenAI's bound)."""
_STRICT = ConfigDict(strict=True, extra="ignore")
_KEEP_SPECIAL = ("mistral", "llama3_json")  # their markers are special tokens


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """An assistant message's earlier call (the history)."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


Tools = list[ToolDef]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolCallsIn = list[ToolCallIn]


def wire_tool_calls(calls: list[ToolCallIn]) -> list[dict]:
    """History calls as transformers' templates take them: arguments as an
    object when they are JSON (else the text as given)."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tools are rendered, enforced and read."""

    mode: str  # "auto", "named" or "required"
    parser: str
    name: str | None = None  # the named function

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice, chat_template: str | None
           ) -> "ToolPlan | None":
        if not tools or tool_choice == "none":
            return None
        supported = template_supports_tools(chat_template) if chat_template else True
        parser = detect_parser(chat_template) if supported else "hermes"
        if tool_choice in (None, "auto"):
            return cls("auto", parser)
        if tool_choice == "required":
            return cls("required", parser)
        return cls("named", parser, named_choice(tool_choice))

    @property
    def keeps_special_tokens(self) -> bool:
        return self.mode == "auto" and self.parser in _KEEP_SPECIAL

    def streamer(self):
        if self.mode == "named":
            return NamedToolStream(self.name)
        if self.mode == "required":
            return RequiredToolStream()
        return ToolStream(self.parser)

    def final(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole output."""
        if self.mode == "named":
            return None, [call_from_named(self.name, text).to_openai()]
        if self.mode == "required":
            return None, [c.to_openai() for c in calls_from_required(text)]
        content, calls = PARSERS[self.parser].parse(text)
        return content, [c.to_openai() for c in calls]

    def finish_reason(self, generated: str | None, num_calls: int) -> str | None:
        if generated == "stop" and num_calls and self.mode != "named":
            return "tool_calls"
        return generated


def prepare(messages: list[dict], tools: list[dict] | None, tool_choice, parallel: bool,
            chat_template: str | None, options: dict
            ) -> tuple[list[dict], ChatOptions | None, StructuredOutput | None,
                       ToolPlan | None]:
    """(messages to render, how to render them, the grammar tool_choice
    forces, the plan) of one chat request; SpecError naming the
    field for bad tools or a bad choice."""
    messages, tools, options = wire_safe(messages), wire_safe(tools), wire_safe(options)
    grammar = tool_grammar(tools, tool_choice, parallel)
    plan = ToolPlan.of(tools, tool_choice, chat_template)
    rendered_tools = tools if plan is not None else None
    if chat_template is not None and not template_supports_tools(chat_template):
        if rendered_tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = fallback_messages(messages, rendered_tools)
        rendered_tools = None
    chat = ChatOptions(tools=rendered_tools, **options)
    return messages, (None if chat == ChatOptions() else chat), grammar, plan


INT_RANGE = (-(2**63), 2**64 - 1)
"""What msgpack carries as an integer (the JE and TEs' wire)."""


def wire_safe(value):
    """A JSON value the wire can carry: an integer past 64 bits (JSON has no
    bound; a tool's schema or a template variable may hold one) becomes the
    float JSON readers in most languages make of it (its digits as text past
    float's range)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if INT_RANGE[0] <= value <= INT_RANGE[1]:
            return value
        try:
            return float(value)
        except OverflowError:  # past float's range too: its digits, as text
            return str(value)
    if isinstance(value, dict):
        return {k: wire_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [wire_safe(v) for v in value]
    return value


def check_one_grammar(grammar: StructuredOutput | None, other: StructuredOutput | None
                      ) -> StructuredOutput | None:
    if grammar is not None and other is not None:
        raise SpecError("tool_choice required or a named function cannot be combined "
                                  "with a structured output", "tool_choice")
    return grammar or other
