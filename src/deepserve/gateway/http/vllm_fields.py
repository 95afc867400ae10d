"""The request fields beyond OpenAI's core set: vLLM's extras we honor, the
ones we refuse, and the ones we ignore.

- Refused (REFUSED): a field vLLM accepts that we do not implement. Sent with
  a value other than vLLM's default, it is a 400 naming it (never silently
  ignored); sent with the default it changes nothing and passes.
- Ignored: a field neither we nor vLLM know (e.g. OpenAI's `store`,
  `metadata`, `service_tier`). It changes nothing, as in vLLM, and the
  response names it in the `X-DeepServe-Ignored-Fields` header.

Structured outputs come in four spellings, all one StructuredOutput:
OpenAI's `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's
`structured_outputs` ({json | regex | choice | grammar | json_object |
structural_tag, disable_any_whitespace, disable_additional_properties}) and
vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. At most one grammar per request (400 otherwise).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from deepserve.errors import InvalidRequestError, SpecError
from deepserve.messages.sampling import StructuredOutput
from deepserve.structured.limits import check_limits

_NONE = None
# field -> vLLM's default (the value a client may send: it changes nothing)
_REFUSED_BOTH: dict[str, Any] = {
    "add_special_tokens": "<endpoint>", "allowed_token_ids": _NONE, "cache_salt": _NONE,
    "ec_transfer_params": _NONE, "kv_transfer_params": _NONE, "length_penalty": 1.0,
    "logprob_token_ids": _NONE, "mm_payload": "tensors", "priority": 0,
    "repetition_detection": _NONE, "request_id": _NONE,
    "return_mm_kwargs": _NONE, "return_token_ids": _NONE, "return_token_offsets": False,
    "routed_experts_prompt_start": 0,
    "session_id": _NONE, "spaces_between_special_tokens": True, "stream_interval": _NONE,
    "thinking_token_budget": _NONE, "truncate_prompt_tokens": _NONE,
    "truncation_side": _NONE, "use_beam_search": False, "vllm_xargs": _NONE,
    "watermarking": _NONE}
REFUSED = {
    "chat": {**_REFUSED_BOTH, "add_special_tokens": False, "chat_template": _NONE,
             "documents": _NONE, "media_io_kwargs": _NONE,
             "mm_processor_kwargs": _NONE, "reasoning_effort": _NONE,
             "return_prompt_text": _NONE, "echo": False},
    "completion": {**_REFUSED_BOTH, "add_special_tokens": True, "prompt_embeds": _NONE,
                   "suffix": _NONE},
}
"""Per endpoint: vLLM's fields we do not implement, with vLLM's default."""

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
"""vLLM's older names of structured_outputs' fields."""
IGNORED_HEADER = "X-DeepServe-Ignored-Fields"
MAX_NAMED_IGNORED = 16
"""Ignored fields named in the header at most (the rest are counted)."""
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def ignored_header(names: list[str]) -> dict[str, str]:
    """The response header naming ignored fields: a field name is the
    client's own JSON key, so only plain names (letters, digits, _ . -, at
    most 64) are written as they are; the others, and any past
    MAX_NAMED_IGNORED, are counted ("+3 more")."""
    if not names:
        return {}
    plain = [n for n in names if _NAME.fullmatch(n)][:MAX_NAMED_IGNORED]
    rest = len(names) - len(plain)
    return {IGNORED_HEADER: ", ".join(plain + ([f"+{rest} more"] if rest else []))}


def check_refused(extra: dict[str, Any], endpoint: str) -> list[str]:
    """The request's fields our model does not declare (pydantic's extras):
    400 for a refused one set off its default; the ignored ones' names."""
    refused = REFUSED[endpoint]
    ignored = []
    for name, value in extra.items():
        if name in GUIDED:
            continue
        if name not in refused:
            ignored.append(name)
        elif value is not None and value != refused[name]:
            raise InvalidRequestError(f"{name!r} is not supported by this server "
                                      "(it is a vLLM field DeepServe does not implement)", name)
    return sorted(ignored)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JSONSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format (type text: no grammar)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    format: dict | None = None  # structural_tag: xgrammar's format
    structures: list[dict] | None = None  # structural_tag: vLLM's older form
    triggers: list[str] | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of the grammar fields."""

    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: None = None
    """Not implemented: any value but null is a 400 (the schema says so too)."""


def structured_output(response_format: ResponseFormat | None,
                      structured: StructuredOutputs | None,
                      extra: dict[str, Any]) -> StructuredOutput | None:
    """The one grammar a request asks for, checked against the limits; None
    when it asks for none. 400 invalid_spec (SpecError) for two, or a bad one."""
    found: list[tuple[str, StructuredOutput]] = []
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", _from_response_format(response_format)))
    if structured is not None:
        found.append(("structured_outputs", _from_structured_outputs(structured)))
    for name, kind in GUIDED.items():
        if extra.get(name) is not None:
            found.append((name, _from_guided(name, kind, extra[name])))
    if len(found) > 1:
        raise SpecError("give at most one of " + ", ".join(n for n, _ in found),
                                  found[1][0])
    if not found:
        return None
    name, out = found[0]
    return check_limits(msgspec.structs.replace(out, field=name), name)


def _from_response_format(rf: ResponseFormat) -> StructuredOutput:
    if rf.type == "json_object":
        return StructuredOutput(kind="json_object")
    if rf.type == "structural_tag":
        spec = ({"structures": rf.structures, "triggers": rf.triggers or []}
                if rf.structures is not None else {"type": "structural_tag", "format": rf.format})
        return StructuredOutput(kind="structural_tag", spec=json.dumps(spec))
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise SpecError("response_format json_schema needs json_schema.schema",
                                  "response_format")
    return StructuredOutput(kind="json", spec=json.dumps(rf.json_schema.schema_))


def _from_structured_outputs(so: StructuredOutputs) -> StructuredOutput:
    given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                 ("grammar", so.grammar), ("structural_tag", so.structural_tag))
             if v is not None]
    if so.json_object:
        given.append(("json_object", True))
    if len(given) != 1:
        raise SpecError("structured_outputs needs exactly one of json, regex, "
                                  "choice, grammar, json_object, structural_tag",
                                  "structured_outputs")
    kind, value = given[0]
    spec = "" if kind == "json_object" else (
        value if isinstance(value, str) and kind in ("json", "regex", "grammar", "structural_tag")
        else json.dumps(value))
    return StructuredOutput(kind=kind, spec=spec, compact=so.disable_any_whitespace)


def _from_guided(name: str, kind: str, value) -> StructuredOutput:
    if kind == "json" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    elif kind == "choice" and isinstance(value, list):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise SpecError(f"{name} has the wrong type", name)
    return StructuredOutput(kind=kind, spec=value)
