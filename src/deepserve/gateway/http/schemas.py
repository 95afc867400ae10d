"""Request bodies of the OpenAI endpoints, and their conversion to SamplingParams.

Models are strict (no "5" -> 5, no true -> 1) and ignore unknown fields like
OpenAI does. An integral JSON number (5.0) is an integer, as in JSON Schema.
Everything a TE would reject for a reason the gateway can see
(ranges, empty or oversized prompts, several prompts) is a 400 here, before
any message is sent.

Sampling fields the client leaves out stay unset in the SamplingParams it
becomes (temperature, top_p, top_k, repetition_penalty, max_tokens): the TE
fills them from the model's generation_config.json (messages/sampling.py).
top_k, repetition_penalty, stop_token_ids and ignore_eos are vLLM's extra
fields, as are min_p, min_tokens, bad_words, include_stop_str_in_output,
skip_special_tokens and the structured-output fields (vllm_fields.py: which
vLLM fields are refused, which unknown ones ignored). An unset max_tokens is
the rest of the context, unless the operator set [gateway] default_max_tokens.
The request models keep unknown top-level fields (`model_extra`) so that
vllm_fields can refuse or name them; nested objects ignore theirs.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

import msgspec
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from deepserve.chat_template import check_template_kwargs
from deepserve.gateway.errors import APIError
from deepserve.gateway.http.prompt_list import MAX_PROMPTS
from deepserve.gateway.http.tool_use import (MAX_TOOLS, ToolCallsIn, ToolChoice, Tools,
                                              wire_tool_calls)
from deepserve.gateway.http.vllm_fields import (ResponseFormat, StructuredOutputs,
                                                check_refused, structured_output)
from deepserve.messages.sampling import MAX_BAD_WORDS, MAX_LOGIT_BIAS, SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_NUM_STOP = 16
MAX_STOP_CHARS = 256
"""Characters of one stop string at most (the TE holds back that much text)."""
MAX_NUM_STOP_TOKEN_IDS = 64
"""stop_token_ids of one request at most (each within the model's vocabulary:
the TE's check)."""
MAX_NUM_MESSAGES = 1024
"""Chat messages of one request at most."""

MAX_CONTEXT_ID_CHARS = 64
MIN_TTL_S, MAX_TTL_S, DEFAULT_TTL_S = 1.0, 7 * 24 * 3600.0, 3600.0
"""A context's lifetime (seconds), as control/je/contexts.py bounds it."""

_STRICT = ConfigDict(strict=True, extra="ignore")


def _integral(value: object) -> object:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds):  # noqa: N802 - a type
    """An int in bounds (Field keywords) that also takes an integral float."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


TokenCount = Int(ge=1, le=2**31 - 1)
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Int(ge=-1, le=2**31 - 1)
"""-1 or 0: every token (vLLM's extra field)."""
RepetitionPenalty = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
"""1: none; Hugging Face's rule over prompt and output (vLLM's extra field)."""
Seed = Int()
"""Any integer; only its value modulo 2**64 counts (wrapped into int64). No
bounds: tools that read a bound near 2**63 as a float disagree at the edge."""
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
"""presence_penalty / frequency_penalty: OpenAI's range."""
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
TOKEN_KEY_PATTERN = r"^[0-9]{1,9}$"
"""A logit_bias key: a token id (below 10**9, so below MAX_TOKEN_ID)."""
TokenKey = Annotated[str, Field(pattern=TOKEN_KEY_PATTERN)]
LogitBias = Annotated[dict[TokenKey, Bias], Field(
    max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})]
"""OpenAI's logit_bias: token id (a JSON key, so a string) -> bias."""
BadWords = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                     Field(max_length=MAX_BAD_WORDS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_NUM_STOP)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: ToolCallsIn | None = None
    """An assistant message's calls (the history of a tool-using chat)."""
    tool_call_id: str | None = None
    """A tool message's answer to that call."""

    def wire(self) -> dict:
        """The message as chat templates take it (tool_use.py)."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = wire_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="allow")
    endpoint: ClassVar[str] = "chat"  # vllm_fields.REFUSED's key
    model: str
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[Int(ge=0, le=MAX_TOKEN_ID)],
                              Field(max_length=MAX_NUM_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    """Generate past the model's EOS tokens (up to max_tokens; vLLM's extra field)."""
    n: Int(ge=1, le=8) | None = None
    user: str | None = None
    context_id: Annotated[str, Field(min_length=1, max_length=MAX_CONTEXT_ID_CHARS)] | None = None
    """A context (POST /v1/contexts) whose messages / prompt come first."""
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    min_tokens: Int(ge=0, le=2**31 - 1) | None = None
    bad_words: BadWords | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: Int(ge=0, le=20) | None = None
    """Each prompt token's logprob and this many alternatives (vLLM's field)."""
    return_tokens_as_token_ids: bool | None = None
    """Logprobs name tokens "token_id:<id>" (vLLM's field; gateway/http/responses.py)."""

    def ignored_fields(self) -> list[str]:
        """400 for a vLLM field we do not implement (set off its default);
        the names of unknown fields, which change nothing (vllm_fields)."""
        return check_refused(self.model_extra or {}, self.endpoint)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  default_max_tokens: int | None) -> SamplingParams:
        """Only what the client set (and the operator's default max_tokens);
        the rest stays unset for the TE to resolve."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else _wrap_int64(self.seed)
        return SamplingParams(
            max_tokens=max_tokens or default_max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, repetition_penalty=self.repetition_penalty,
            stop=stop, seed=seed, logprobs=logprobs, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=bool(self.ignore_eos), **self._set_numbers(),
            logit_bias=_logit_bias(self.logit_bias), min_tokens=self.min_tokens or 0,
            bad_words=list(self.bad_words or []),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            prompt_logprobs=self.wanted_prompt_logprobs,
            structured=structured_output(self.response_format, self.structured_outputs,
                                         self.model_extra or {})).validate()

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _set_numbers(self) -> dict:
        """min_p and the penalties the client set to something but their
        default (0): an unset one stays off the wire."""
        return {name: value for name in ("min_p", "presence_penalty", "frequency_penalty")
                if (value := getattr(self, name))}

    def sampling_per_choice(self, default_max_tokens: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i gets seed + i."""
        base = self.sampling(default_max_tokens)
        if base.seed is None:
            return [base] * self.num_choices
        return [msgspec.structs.replace(base, seed=_wrap_int64(base.seed + i))
                for i in range(self.num_choices)]

    def sampling(self, default_max_tokens: int | None) -> SamplingParams:
        raise NotImplementedError


_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}


class ChatCompletionRequest(_GenerationRequest):
    # the schema says it too: top_logprobs needs logprobs: true (else 400)
    model_config = ConfigDict(strict=True, extra="allow",
                              json_schema_extra=_TOP_LOGPROBS_NEED_LOGPROBS)
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_NUM_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Int(ge=0, le=20) | None = None
    tools: Annotated[Tools, Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    """The template's own variables (e.g. enable_thinking); chat_template.py."""
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    include_reasoning: bool = True
    """reasoning_content in the answer, for a model that thinks (reasoning.py)."""

    def tool_inputs(self) -> tuple[list[dict] | None, object, bool]:
        """(tools as dicts, tool_choice as sent, parallel_tool_calls)."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        choice = (self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel)
                  else self.tool_choice)
        return tools, choice, self.parallel_tool_calls is not False

    def template_options(self) -> dict:
        """ChatOptions' fields besides tools."""
        return {"add_generation_prompt": self.add_generation_prompt is not False
                and not self.continue_final_message,
                "continue_final_message": bool(self.continue_final_message),
                "template_kwargs": check_template_kwargs(self.chat_template_kwargs) or None}

    def sampling(self, default_max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.max_completion_tokens or self.max_tokens, logprobs,
                              default_max_tokens)

    def wire_messages(self, max_chars: int) -> list[dict]:
        """messages as the TE's chat template takes them; 400 when too long."""
        wire = [m.wire() for m in self.messages]
        num_chars = sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", "")))
                        for m in wire)
        num_chars += len(json.dumps(self.tool_inputs()[0] or ""))
        if num_chars > max_chars:
            raise APIError.prompt_too_long(
                f"messages have {num_chars} characters; at most {max_chars} are accepted",
                "messages")
        return wire


TokenIds = Annotated[list[Int(ge=0, le=MAX_TOKEN_ID)], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]
# A prompt, or a list of up to MAX_PROMPTS of them (prompt_list.py).
Prompt = (PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
          | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(_GenerationRequest):
    endpoint: ClassVar[str] = "completion"
    prompt: Prompt
    logprobs: Int(ge=0, le=20) | None = None
    echo: bool | None = None
    """The prompt comes first in the text (and, with logprobs, in the
    logprobs: its tokens' logprobs, the first one null)."""

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """echo with logprobs needs the prompt's, with as many alternatives."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def sampling(self, default_max_tokens: int | None) -> SamplingParams:
        return self._sampling(self.max_tokens, self.logprobs, default_max_tokens)

    def wire_prompts(self, max_chars: int) -> list[tuple[str | None, list[int] | None]]:
        """Per prompt: (prompt text, prompt token ids), exactly one set; 400
        when one is too long, or all of them together are.
        (Emptiness and id ranges are the model's own checks.)"""
        prompt = self.prompt
        many = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) \
            else [prompt]
        if sum(len(p) for p in many) > max_chars:
            raise APIError.prompt_too_long(
                f"prompt has {sum(len(p) for p in many)} characters or tokens; at most "
                f"{max_chars} are accepted", "prompt")
        return [(p, None) if isinstance(p, str) else (None, list(p)) for p in many]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys -> token ids; 400 for a key that is no integer
    (the TE checks each id against its vocabulary)."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError.bad_request(f"logit_bias key {key!r} is not a token id",
                                       "logit_bias") from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise APIError.bad_request(f"logit_bias token {token} is out of range", "logit_bias")
        out[token] = float(value)
    return out


def _wrap_int64(value: int) -> int:
    return (value - INT64_MIN) % 2**64 + INT64_MIN


_EXACTLY_ONE_INPUT = {"oneOf": [
    {"required": ["messages"], "not": {"required": ["prompt"]}},
    {"required": ["prompt"], "not": {"required": ["messages"]}}]}


class ContextCreateRequest(BaseModel):
    """POST /v1/contexts: messages (for chat) or a prompt (for completions),
    exactly one of them, kept with its KV until ttl_s seconds have passed or it
    is deleted."""

    model_config = ConfigDict(**_STRICT, json_schema_extra=_EXACTLY_ONE_INPUT)
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1,
                                                 max_length=MAX_NUM_MESSAGES)] = None
    prompt: PromptText | TokenIds = None
    ttl_s: Annotated[float, Field(ge=MIN_TTL_S, le=MAX_TTL_S, allow_inf_nan=False)] = \
        DEFAULT_TTL_S

    def wire_input(self, max_chars: int) -> dict:
        """{messages} or {prompt | prompt_token_ids}; 400 for none, both, or too long."""
        if (self.messages is None) == (self.prompt is None):
            raise APIError.bad_request("give exactly one of messages and prompt", "messages")
        if self.messages is not None:
            wire = [{"role": m.role, "content": m.text()} for m in self.messages]
            if sum(len(m["content"]) for m in wire) > max_chars:
                raise APIError.prompt_too_long(f"messages have more than {max_chars} "
                                               "characters", "messages")
            return {"messages": wire}
        if len(self.prompt) > max_chars:
            raise APIError.prompt_too_long(f"prompt has more than {max_chars} characters or "
                                           "tokens", "prompt")
        if isinstance(self.prompt, str):
            return {"prompt": self.prompt}
        return {"prompt_token_ids": list(self.prompt)}
