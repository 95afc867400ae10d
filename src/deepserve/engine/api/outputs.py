"""What a finished (or streaming) request hands back to its caller."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob)


@dataclass
class RequestOutput:
    """finish_reason: "stop" (EOS, stop token or stop string), "length"
    (max_tokens or max_model_len), "abort"; None while still running.
    cached_tokens: prompt tokens served from the prefix cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    delta: str = ""  # text added by the last step (streaming)
    prompt_logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.prompt_logprobs: each prompt token's after the first."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
