"""LLM: the offline Python API, in the shape vLLM users know.

    llm = LLM(model="models/tiny", max_num_batched_tokens=512)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=16))
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
    for piece in llm.stream("Once", SamplingParams(max_tokens=8)): print(piece.delta)

In-process (default) it drives an LLMEngine step by step; with
`processes=True` (and `tp=N`) the same calls go to a TE of processes
through an EngineClient.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Iterator, Sequence

from deepserve.config import EngineConfig
from deepserve.engine.api.llm_engine import LLMEngine
from deepserve.engine.api.outputs import RequestOutput, TokenLogprob
from deepserve.engine.te.client import EngineClient
from deepserve.errors import (EngineDeadError, InvalidRequestError, PromptTooLongError)
from deepserve.messages.engine import RequestDelta, RequestFailed, SubmitRequest
from deepserve.messages.sampling import SamplingParams
from deepserve.model.gguf import resolve_model
from deepserve.tokenizer import Tokenizer

Prompt = str | list[int]
_ERRORS = {"invalid_request": InvalidRequestError, "prompt_too_long": PromptTooLongError}


class LLM:
    def __init__(self, model: str, **options):
        """options: EngineConfig's; with processes=True also tier_address (a
        node KV tier service, tiers/tier_server.py) and cache_cost_model.
        A .gguf model is imported first (into gguf_cache_dir, default
        $DEEPSERVE_GGUF_CACHE or ~/.cache/deepserve/gguf; cached by content)."""
        tiers = {k: options.pop(k) for k in ("tier_address", "cache_cost_model") if k in options}
        model = resolve_model(model, options.pop("gguf_cache_dir", None))
        config = EngineConfig.from_options(model, **options)
        self.engine = self.client = None
        if tiers and not config.processes:
            raise ValueError("tier_address and cache_cost_model need processes=True")
        if config.processes:
            self.client = EngineClient(config, **tiers)
            self.tokenizer = Tokenizer(config.model)
        else:
            self.engine = LLMEngine(config)
            self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; results in prompt order. A bad prompt
        raises InvalidRequestError and the batch's other requests are dropped."""
        prompts = _as_prompt_list(prompts)
        requests = self._submit(prompts, _as_params_list(sampling_params, len(prompts)))
        done = {}
        for out in self._outputs(requests):
            if out.finished:
                done[out.request_id] = out
        return [done[r] for r in requests]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(ids, sampling_params)
        for out, prompt in zip(outs, prompts):
            out.prompt = prompt
        return outs

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Each request's output whenever it grows (`.delta` is the new text),
        until all have finished."""
        prompts = _as_prompt_list(prompts)
        requests = self._submit(prompts, _as_params_list(sampling_params, len(prompts)))
        yield from self._outputs(requests)

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- both modes ------------------------------------------------------------
    def _submit(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        for p in params:
            p.validate()
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self._add(prompt, p))
        except InvalidRequestError:
            for request_id in ids:
                self._abort(request_id)
            raise
        return ids

    def _add(self, prompt: Prompt, sampling: SamplingParams) -> str:
        if self.engine is not None:
            return self.engine.add_request(prompt, sampling)
        request_id = uuid.uuid4().hex
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            msg = SubmitRequest(request_id=request_id, prompt=prompt, sampling=sampling)
        elif isinstance(prompt, list):
            msg = SubmitRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        self.client.submit(msg)
        return request_id

    def _abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort_request(request_id)
        else:
            self.client.abort(request_id)

    def _outputs(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        if self.engine is not None:
            yield from self._engine_outputs(set(request_ids))
        else:
            yield from self._client_outputs(request_ids)

    def _engine_outputs(self, open_ids: set[str]) -> Iterator[RequestOutput]:
        while open_ids:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("engine went idle with requests unanswered")
            for out in self.engine.step():
                if out.request_id in open_ids:
                    yield out
                    if out.finished:
                        open_ids.discard(out.request_id)

    def _client_outputs(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        outputs = {r: RequestOutput(r, None, [], [], "", None, 0) for r in request_ids}
        open_ids, error = set(request_ids), None
        while open_ids:
            for msg in self.client.poll(timeout=0.1):
                out = outputs.get(msg.request_id)
                if out is None or msg.request_id not in open_ids:
                    continue
                if isinstance(msg, RequestFailed):
                    open_ids.discard(msg.request_id)
                    if error is None:
                        error = _ERRORS.get(msg.error, EngineDeadError)(msg.message)
                        for other in open_ids:
                            self._abort(other)
                    continue
                _apply_delta(out, msg)
                if out.finished:
                    open_ids.discard(msg.request_id)
                if error is None:
                    yield dataclasses.replace(out)  # a snapshot, as in-process steps give
        if error is not None:
            raise error


def _apply_delta(out: RequestOutput, delta: RequestDelta) -> None:
    if delta.prompt_token_ids is not None:
        out.prompt, out.prompt_token_ids = delta.prompt, delta.prompt_token_ids
    out.token_ids = out.token_ids + delta.token_ids
    out.text += delta.text
    out.delta = delta.text
    out.finish_reason = delta.finish_reason
    out.cached_tokens = delta.cached_tokens
    if delta.logprobs is not None:
        out.logprobs = (out.logprobs or []) + [TokenLogprob(t, lp, [tuple(x) for x in top])
                                               for t, lp, top in delta.logprobs]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts must be a string, token ids, or a non-empty list",
                                  "prompt")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts",
                                  "sampling_params")
    return params
