"""One generation request, from a validated body to a response or an event stream.

    body ──check model, sampling, prompt──> JobClient.submit (n sub-requests)
         ──wait for every sub-request's first reply──> (errors still become a JSON 4xx/5xx)
         ├─ stream=false: collect every delta ──> one response object
         └─ stream=true:  200 + SSE: opening chunks, delta chunks, [usage chunk], [DONE]

The reply stream is closed on every exit path (success, error, deadline,
client gone, cancellation): closing aborts whatever has not finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import msgspec
from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.errors import APIError, from_exception
from deepserve.gateway.link.job_client import JobClient
from deepserve.gateway.link.reply_stream import ReplyStream
from deepserve.gateway.metrics import GatewayMetrics
from deepserve.ipc.timeline import Timeline, token_key
from deepserve.gateway.http.chat_response import ChatRenderer
from deepserve.gateway.http.responses import Choice, CompletionRenderer, Renderer, Usage
from deepserve.gateway.http.prompt_list import PromptStreams
from deepserve.gateway.http.reasoning import has_reasoning
from deepserve.gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from deepserve.gateway.http.tool_use import ToolPlan, check_one_grammar, prepare
from deepserve.gateway.http.vllm_fields import ignored_header
from deepserve.messages.contexts import PinTurn
from deepserve.messages.sampling import SamplingParams

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class GatewayState:
    """What every handler shares; lives in `app.state.gateway`."""

    config: GatewayConfig
    client: JobClient
    metrics: GatewayMetrics
    timeline: Timeline = field(default_factory=lambda: Timeline("gateway"))
    """Off unless $DEEPSERVE_TIMELINE names a folder (ipc/timeline.py)."""


NO_ENGINE_WAIT_S = 10.0
"""How long a request waits for a TE of its model before 503 no engine: while
every TE of it restarts at once (overlapping faults), or before a (re)started
gateway's first TE list (the CM republishes every second). A 60-minute chaos
run with a fault every 20 s was refused 747 times in such windows, a restarted
gateway 123 times, while the TEs came back within seconds."""


async def until_servable(client: JobClient, model: str) -> None:
    """Returns once a TE can take `model` (JobClient.can_serve), or after
    NO_ENGINE_WAIT_S (then submit answers 503)."""
    deadline = time.monotonic() + NO_ENGINE_WAIT_S
    while not client.can_serve(model) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def generate(request: Request, state: GatewayState,
                   body: ChatCompletionRequest | CompletionRequest, tenant: str) -> Response:
    config = state.config
    if body.model not in config.served_models:
        raise APIError.model_not_found(body.model)
    headers = ignored_header(body.ignored_fields())
    samplings = body.sampling_per_choice(config.default_max_tokens)
    if isinstance(body, ChatCompletionRequest):
        template = await _chat_template(request, body.model)
        inputs, samplings, plan = _chat_inputs(body, samplings, config.max_prompt_chars,
                                               template)
        prompts = [inputs]
        renderer: Renderer = ChatRenderer(
            f"chatcmpl-{uuid.uuid4().hex}", body.model, bool(body.logprobs),
            body.include_usage, bool(body.return_tokens_as_token_ids), tools=plan,
            with_prompt_logprobs=body.prompt_logprobs is not None,
            reasoning=has_reasoning(template), include_reasoning=body.include_reasoning,
            # `stream` is bound below, before any reply: choice i is its sub-request i
            on_tool_calls=lambda i: state.client.notify(PinTurn(request_id=stream.request_ids[i])))
    else:
        prompts = [{"prompt": text, "prompt_token_ids": ids}
                   for text, ids in body.wire_prompts(config.max_prompt_chars)]
        echo = [await _echo_text(request, body.model, p["prompt"], p["prompt_token_ids"])
                for p in prompts] if body.echo else None
        renderer = CompletionRenderer(
            f"cmpl-{uuid.uuid4().hex}", body.model, body.logprobs is not None,
            body.include_usage, bool(body.return_tokens_as_token_ids), echo=echo,
            choices_per_prompt=len(samplings),
            with_prompt_logprobs=body.prompt_logprobs is not None)
    await until_servable(state.client, body.model)
    stream = _submit(state.client, request, renderer.response_id, samplings, prompts,
                     salt=tenant, model=body.model, context_id=body.context_id)
    try:
        await stream.wait_started()
    except BaseException:
        stream.close()
        raise
    num_choices = len(samplings) * len(prompts)
    if body.stream:
        # From here Starlette's own disconnect listener owns `receive`.
        stream.is_disconnected = None
        return ClosingStreamingResponse(_events(stream, renderer, num_choices, len(samplings),
                                                state.timeline),
                                        on_close=stream.close, headers={**SSE_HEADERS, **headers},
                                        media_type="text/event-stream")
    try:
        return JSONResponse(await _collect(stream, renderer, num_choices, len(samplings)),
                            headers=headers)
    finally:
        stream.close()


def _submit(client: JobClient, request: Request, response_id: str,
            samplings: list[SamplingParams], prompts: list[dict], **common
            ) -> ReplyStream | PromptStreams:
    """One stream of n sub-requests per prompt; several read as one."""
    streams: list[ReplyStream] = []
    try:
        for p, inputs in enumerate(prompts):
            rid = response_id if len(prompts) == 1 else f"{response_id}-p{p}"
            streams.append(client.submit(rid, samplings, is_disconnected=request.is_disconnected,
                                         **common, **inputs))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams[0] if len(streams) == 1 else PromptStreams(streams, len(samplings))


def _chat_inputs(body: ChatCompletionRequest, samplings: list[SamplingParams],
                 max_chars: int, template: str | None
                 ) -> tuple[dict, list[SamplingParams], ToolPlan | None]:
    """(submit's inputs, the samplings with the grammar tool_choice forces,
    the tool plan) of a chat request (tool_use.py)."""
    tools, choice, parallel = body.tool_inputs()
    messages, chat, grammar, plan = prepare(body.wire_messages(max_chars), tools, choice,
                                            parallel, template, body.template_options())
    changes = {}
    if grammar is not None:
        changes["structured"] = check_one_grammar(grammar, samplings[0].structured)
    if plan is not None and plan.keeps_special_tokens:
        changes["skip_special_tokens"] = False
    if changes:
        samplings = [msgspec.structs.replace(s, **changes) for s in samplings]
    return {"messages": messages, "chat": chat}, samplings, plan


async def _echo_text(request: Request, model: str, prompt: str | None,
                     prompt_token_ids: list[int] | None) -> str:
    """The prompt as echo puts it before the output: its text, or its ids
    decoded by the gateway's tokenizer of the model (special tokens kept)."""
    if prompt is not None:
        return prompt
    tokens = getattr(request.app.state, "tokens", None)
    if tokens is None or model not in tokens.config.model_dirs:
        raise APIError.bad_request("echo of a token-id prompt needs the model's tokenizer at "
                                   "the gateway", "echo")
    return (await tokens.tokenizer(model)).decode(prompt_token_ids, skip_special_tokens=False)


async def _chat_template(request: Request, model: str) -> str | None:
    """The model's chat template as the gateway's tokenizer of it reads it;
    None when the gateway has none (the JE renders whatever it is)."""
    tokens = getattr(request.app.state, "tokens", None)
    if tokens is None or model not in tokens.config.model_dirs:
        return None
    try:
        return (await tokens.tokenizer(model)).chat_template
    except APIError:
        return None


async def _collect(stream: ReplyStream, renderer: Renderer, num_choices: int,
                   per_prompt: int) -> dict:
    choices = [Choice(i) for i in range(num_choices)]
    usage = Usage(num_choices, per_prompt)
    async for index, delta in stream:
        choices[index].add(delta)
        usage.add(index, delta)
    return renderer.response(choices, usage)


async def _events(stream: ReplyStream, renderer: Renderer, num_choices: int, per_prompt: int,
                  timeline: Timeline) -> AsyncIterator[bytes]:
    """Server-sent events; an error after the 200 becomes an error event.
    With the timeline on, each delta's span runs from the writer having it
    to its event written (the server asks for the next one once it is)."""
    usage = Usage(num_choices, per_prompt)
    try:
        for chunk in renderer.opening_chunks(num_choices):
            yield _sse(chunk)
        async for index, delta in stream:
            got = time.monotonic()
            usage.add(index, delta)
            for chunk in renderer.delta_chunks(index, delta):
                yield _sse(chunk)
            if timeline.on:
                timeline.add("sse", -1, got, time.monotonic(), len(delta.token_ids),
                             token_key(delta.request_id, usage.completion_tokens[index]))
        if renderer.include_usage:
            yield _sse(renderer.usage_chunk(usage))
    except Exception as exc:  # noqa: BLE001 - the stream must end with an error event
        err = from_exception(exc)
        if not isinstance(exc, APIError):
            logger.error("stream %s failed", renderer.response_id, exc_info=exc)
        yield _sse(err.body())
    finally:
        stream.close()
    yield b"data: [DONE]\n\n"


_json = msgspec.json.Encoder()


def _sse(obj: dict) -> bytes:
    """One event: msgspec's encoder (a fraction of json.dumps' time per token);
    text it cannot take as UTF-8 (a lone surrogate from a client's own input,
    echoed in an error) is escaped by json instead."""
    try:
        data = _json.encode(obj)
    except UnicodeEncodeError:
        data = json.dumps(obj, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends: a client
    that disconnects cancels the body iterator, which may not get to run its
    own `finally` before it is garbage collected."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
