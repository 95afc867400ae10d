"""LLM: the offline Python API, in the shape vLLM users know.

    llm = LLM(model="models/tiny", max_num_batched_tokens=512)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=16))
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from typing import Sequence

from deepserve.config import EngineConfig
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.outputs import RequestOutput
from deepserve.errors import InvalidRequestError
from deepserve.messages.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **options):
        self.engine = LLMEngine(EngineConfig.from_options(model, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; results in prompt order.

        Every prompt is checked before any is queued: a bad one raises
        InvalidRequestError and nothing runs."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except InvalidRequestError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt)
                   for c in conversations]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(ids, sampling_params)
        for out, prompt in zip(outs, prompts):
            out.prompt = prompt
        return outs

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(request_ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
            if not self.engine.has_unfinished_requests() and len(done) < len(request_ids):
                raise RuntimeError("engine went idle with requests unanswered")
        return [done[i] for i in request_ids]


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
