"""The channels of one TE and their wire types (one tagged union per channel).

    client ──ToTokenizer──> tokenizer ──ToMaster──> master ──StepBatch (ring)──> workers
      ^                       │  ^                    │  ^                          │
      │                       │  └──── StepTokens ────┘  └──── StepOutput (rank 0) ┘
      └──── ToClient ─────────┘   (text goes straight back: the streaming shortcut;
                                   the master and the launcher also report failures)

Workers also send WorkerReady / WorkerFailed to the master. Masters of
different TEs talk PD (messages/pd.py) on a socket of their own.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from deepserve.messages.cache import CacheOpsDone, ContextPin
from deepserve.messages.contexts import ContextInfo
from deepserve.messages.pd import FailRequest, KVEndpoint, KVSent
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import StepOutput

TenantWeight = Annotated[float, Meta(gt=0, le=1000)]
"""A tenant's share relative to the others ([tenants] weight, config/tenants.py)."""

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)


# -- client -> tokenizer ----------------------------------------------------
class ChatOptions(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """How the chat template renders a request's messages (chat_template.py):
    tools for templates that render them, the generation prompt or an
    open-ended final message, and the client's own template variables."""

    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict | None = None

    def render_options(self) -> dict:
        return {"add_generation_prompt": self.add_generation_prompt, "tools": self.tools,
                "continue_final_message": self.continue_final_message,
                "template_kwargs": self.template_kwargs}


class SubmitRequest(msgspec.Struct, tag="submit", **_STRUCT):
    """prompt: text, or token ids already; chat: messages to render first.
    salt: the tenant's prefix-cache salt (set by the gateway, never a client);
    reply_to: where this request's deltas go (default: the TE's own client);
    prefill_from: set on the decode task of a disaggregated job, the prefill
    TE's inbox (see messages/pd.py);
    attempt: 0 for a new request; n when it resumes after its TE was lost
    (prompt_token_ids then end with the tokens already streamed);
    resumed_output_ids: on a resumed attempt, how many of prompt_token_ids (at
    the end) are output the caller already received tokens of, and
    resumed_text_chars how many characters of their text it received: the
    TE detokenizes from those ids on and streams only the text past that
    point, so the caller's text has no gap and no repeat.
    tenant: who pays for the request (the API key's tenant, set by the
    gateway): the job executor's fair queue and per-tenant limits;
    tenant_weight: (JE -> TE) the tenant's [tenants] weight, its share of a
    step that other tenants' sequences share (engine/scheduler.py);
    done_to: (JE -> TE) where the TE's tokenizer sends TaskDone when the
    request ends there, any way (the JE frees its slot on that TE);
    queued_s: (JE -> TE) seconds it waited in the JE's fair queue, echoed on
    the first RequestDelta (the gateway's per-tenant queue-wait metric)."""

    request_id: str
    model: str | None = None  # the served model name; None: the node's first model
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    chat: ChatOptions | None = None  # how messages are rendered (None: the defaults)
    sampling: SamplingParams
    salt: str | None = None
    reply_to: str | None = None
    prefill_from: str | None = None
    attempt: int = 0
    resumed_output_ids: int = 0
    resumed_text_chars: int = 0
    context_id: str | None = None  # gateway -> JE: a context's prompt comes first
    pin_context: ContextPin | None = None  # JE -> TE: this request creates that context
    read_path: str | None = None  # JE -> decode TE: "decode" (DualPath: read storage here)
    tenant: str | None = None
    tenant_weight: TenantWeight = 1.0
    done_to: str | None = None
    queued_s: float = 0.0


class AbortRequest(msgspec.Struct, tag="abort", **_STRUCT):
    request_id: str


class TaskDone(msgspec.Struct, tag="task_done", **_STRUCT):
    """TE tokenizer -> JE (SubmitRequest.done_to): the request's attempt
    ended on this TE (finished, aborted, failed or refused): its slot is free."""

    request_id: str
    attempt: int = 0


# -- tokenizer -> master ----------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", **_STRUCT):
    """A checked request; its sampling resolved (the model's defaults in
    every field the client left unset: messages/sampling.py)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    salt: str | None = None
    prefill_from: str | None = None
    pin_context: ContextPin | None = None
    read_path: str | None = None
    tenant: str | None = None
    tenant_weight: TenantWeight = 1.0


class FinishRequest(msgspec.Struct, tag="finish", **_STRUCT):
    """Abort by the client, or a stop string the detokenizer found."""

    request_id: str
    reason: str


class GetStats(msgspec.Struct, tag="get_stats", **_STRUCT):
    """Ask the master for its EngineStats (answered to the client)."""


ToMaster = AddRequest | FinishRequest | GetStats


# -- master -> tokenizer ----------------------------------------------------
class NewTokens(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request; finish_reason set on its last message."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    """On the first message of a request that asked: SampledToken.prompt."""


class StepTokens(msgspec.Struct, tag="tokens", **_STRUCT):
    """items: one per request that advanced; step_id: the step that made
    them (-1: not a step's, e.g. a context pinned), for the step timeline."""

    items: list[NewTokens]
    step_id: int = -1


# The tokenizer process binds one PULL socket (the TE's inbox): clients and
# its master push to it.
ToTokenizer = SubmitRequest | AbortRequest | StepTokens | GetStats | FailRequest


# -- tokenizer / master / launcher -> client ----------------------------------
class RequestDelta(msgspec.Struct, tag="delta", **_STRUCT):
    """What one request gained since its last delta. token_bytes: with
    logprobs, the exact bytes of every token id they name (sampled and top
    alternatives; Tokenizer.token_bytes), so the gateway shows token strings
    and bytes with no tokenizer work of its own per token."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # on the first delta
    cached_tokens: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    """On the first delta of a request that asked: each prompt token's after the first."""
    token_bytes: dict[int, bytes] | None = None
    attempt: int = 0  # the SubmitRequest's: a late delta of an earlier attempt is dropped
    queued_s: float = 0.0  # on the first delta: the SubmitRequest's queued_s


RETRYABLE_ERRORS = ("te_lost", "kv_transfer_failed")


class RequestFailed(msgspec.Struct, tag="failed", **_STRUCT):
    """error: "invalid_request", "prompt_too_long", "engine_dead", or one of
    RETRYABLE_ERRORS: the request's TE (or its KV transfer) failed and the
    caller may resubmit it with the tokens it has as a resumed attempt.
    "rate_limited": the tenant is at one of its limits (HTTP 429); retry
    after retry_after_s seconds."""

    request_id: str
    error: str
    message: str
    param: str | None = None
    retry_after_s: int = 0


class EngineStats(msgspec.Struct, tag="stats", **_STRUCT):
    """forward_spans: (start, end) time.monotonic() of the workers' recent
    forwards, oldest first; num_preemptions so far."""

    forward_spans: list[tuple[float, float]]
    num_preemptions: int


ToClient = RequestDelta | RequestFailed | EngineStats | ContextInfo


# -- workers -> master ---------------------------------------------------------
class StepDone(msgspec.Struct, tag="step_done", **_STRUCT):
    """Rank 0's result of one step; forward_start/end are time.monotonic()
    stamps (one clock for every process on the node) for the busy fraction."""

    output: StepOutput
    forward_start: float
    forward_end: float


class WorkerReady(msgspec.Struct, tag="ready", **_STRUCT):
    rank: int
    pid: int
    kv_endpoint: KVEndpoint | None = None


class WorkerFailed(msgspec.Struct, tag="worker_failed", **_STRUCT):
    rank: int
    message: str


FromWorker = StepDone | WorkerReady | WorkerFailed | KVSent | CacheOpsDone
