"""tool_choice as a grammar: the calls a request forces, and the calls read back.

    tool_choice                      grammar (a JSON schema)          output read by
    None / "auto" / "none"           none (free text; parsers.py)     a parser
    {"type": "function",             that function's parameters       call_from_named
     "function": {"name": N}}
    "required"                       [{"name": N, "parameters": {..}}, calls_from_required
                                      ...], one item at least (exactly
                                      one without parallel_tool_calls)

Forcing a call through the grammar, as vLLM does, works with every model,
whatever format its chat template teaches: the output cannot be anything but
the call, so there is nothing to parse out of free text. Each function's
"$defs" move to the top of the "required" schema, where their "#/$defs/..."
references still point.

The tools themselves are checked here too (tool_grammar always checks them):
a name must be 1-64 of [A-Za-z0-9_.-] and unique, parameters a JSON schema
object. SpecError (HTTP 400 invalid_spec) names "tools" or "tool_choice".
"""

from __future__ import annotations

import copy
import json

from deepserve.errors import SpecError
from deepserve.messages.sampling import StructuredOutput
from deepserve.tool_calls.parsers import NAME_PATTERN, ToolCall, arguments_text

MAX_NAME_CHARS = 64
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
"""The schema of a function that declares no parameters."""


def tool_grammar(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool = True
                 ) -> StructuredOutput | None:
    """The grammar tool_choice forces, or None when the output is free text."""
    functions = check_tools(tools)
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        if not functions:
            raise SpecError('tool_choice "required" needs at least one tool',
                                      "tool_choice")
        return _json(_required_schema(functions, parallel_tool_calls))
    name = named_choice(tool_choice)
    if name not in functions:
        raise SpecError(f"tool_choice names function {name!r}, which is not in tools",
                        "tool_choice")
    return _json(functions[name] or EMPTY_PARAMETERS)


def check_tools(tools: list[dict] | None) -> dict[str, dict | None]:
    """name -> parameters schema (None when not given) of each tool, in
    order; SpecError("tools") for a malformed list."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise SpecError("tools must be a list", "tools")
    functions: dict[str, dict | None] = {}
    for i, tool in enumerate(tools):
        name, parameters = _function_of(tool, i)
        if name in functions:
            raise SpecError(f"tools names function {name!r} twice", "tools")
        functions[name] = parameters
    return functions


def named_choice(tool_choice) -> str:
    """N of {"type": "function", "function": {"name": N}}."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise SpecError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")


def check_name(name, param: str = "tools") -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS \
            or not NAME_PATTERN.fullmatch(name):
        raise SpecError(f"function name {name!r} must be 1 to {MAX_NAME_CHARS} "
                                  "characters of a-z, A-Z, 0-9, '_', '.' and '-'", param)
    return name


def _function_of(tool, i: int) -> tuple[str, dict | None]:
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise SpecError(f'tools[{i}] must be {{"type": "function", '
                                  '"function": {...}}', "tools")
    function = tool["function"]
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise SpecError(f"tools[{i}].function.parameters must be a JSON schema "
                                  "object", "tools")
    return check_name(function.get("name")), parameters


def _required_schema(functions: dict[str, dict | None], parallel: bool) -> dict:
    defs: dict[str, dict] = {}
    items = [_item_schema(name, parameters, defs) for name, parameters in functions.items()]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _item_schema(name: str, parameters: dict | None, defs: dict[str, dict]) -> dict:
    """One function's item; its "$defs" join `defs` (a clash is an error)."""
    parameters = copy.deepcopy(parameters) if parameters else dict(EMPTY_PARAMETERS)
    own = parameters.pop("$defs", {})
    if not isinstance(own, dict):
        raise SpecError(f"$defs of function {name!r} must be an object", "tools")
    for key, schema in own.items():
        if defs.setdefault(key, schema) != schema:
            raise SpecError(f"$defs {key!r} differs between functions", "tools")
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [name]},
                           "parameters": parameters},
            "required": ["name", "parameters"]}


def _json(schema: dict) -> StructuredOutput:
    return StructuredOutput(kind="json", spec=json.dumps(schema), field="tool_choice")


# -- reading the constrained output back ------------------------------------
def call_from_named(name: str, text: str) -> ToolCall:
    """The output of a named choice is the arguments object itself."""
    return ToolCall(name=name, arguments=arguments_text(text))


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of a "required" output, one per complete array item; an
    item that is no call (an output cut short) is left out."""
    items = ArrayItems()
    return [call for item in items.feed(text) if (call := required_call(item))]


def required_call(item: str) -> ToolCall | None:
    """The call of one {"name": ..., "parameters": {...}} item."""
    try:
        obj = json.loads(item)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
            or not isinstance(obj.get("parameters"), dict):
        return None
    return ToolCall(name=obj["name"], arguments=arguments_text(obj["parameters"]))


class ArrayItems:
    """The complete object items of a JSON array, as text, as it streams in.

    Brackets count only outside JSON strings (a string may hold "}" or an
    escaped quote); an item ends when the bracket that opened it closes.
    Depth 1 is inside the array; an item opens with a "{" there and ends
    when the depth is back at 1 (anything else at depth 1 is skipped)."""

    def __init__(self):
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item: list[str] = []

    def feed(self, text: str) -> list[str]:
        done = []
        for char in text:
            if self._item or (self._depth == 1 and char == "{" and not self._in_string):
                self._item.append(char)
            if self._in_string:
                self._string_char(char)
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and self._item:
                    done.append("".join(self._item))
                    self._item = []
        return done

    def _string_char(self, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
