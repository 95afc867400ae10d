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
fields. An unset max_tokens is the rest of the context, unless the operator
set [gateway] default_max_tokens.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from deepserve.gateway.errors import APIError
from deepserve.messages.sampling import SamplingParams

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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT
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
            ignore_eos=bool(self.ignore_eos)).validate()

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
    model_config = ConfigDict(**_STRICT, json_schema_extra=_TOP_LOGPROBS_NEED_LOGPROBS)
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_NUM_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Int(ge=0, le=20) | None = None

    def sampling(self, default_max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.max_completion_tokens or self.max_tokens, logprobs,
                              default_max_tokens)

    def wire_messages(self, max_chars: int) -> list[dict]:
        """messages as the TE's chat template takes them; 400 when too long."""
        wire = [{"role": m.role, "content": m.text()} for m in self.messages]
        num_chars = sum(len(m["content"]) for m in wire)
        if num_chars > max_chars:
            raise APIError.prompt_too_long(
                f"messages have {num_chars} characters; at most {max_chars} are accepted",
                "messages")
        return wire


TokenIds = Annotated[list[Int(ge=0, le=MAX_TOKEN_ID)], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]
# One prompt per request: a list of prompts must hold exactly one.
Prompt = (PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=1)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    logprobs: Int(ge=0, le=20) | None = None

    def sampling(self, default_max_tokens: int | None) -> SamplingParams:
        return self._sampling(self.max_tokens, self.logprobs, default_max_tokens)

    def wire_prompt(self, max_chars: int) -> tuple[str | None, list[int] | None]:
        """(prompt text, prompt token ids), exactly one set; 400 when too long.
        (Emptiness, several prompts and id ranges are the model's own checks.)"""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if len(prompt) > max_chars:
            raise APIError.prompt_too_long(
                f"prompt has {len(prompt)} characters or tokens; at most {max_chars} are "
                "accepted", "prompt")
        if isinstance(prompt, str):
            return prompt, None
        return None, list(prompt)


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
