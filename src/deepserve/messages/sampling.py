"""SamplingParams: how one request wants its tokens chosen and when to stop.

It is a msgspec Struct because it travels (gateway -> job executor -> TE
master -> workers); `validate()` raises InvalidRequestError naming the field,
so every entry point rejects bad input the same way before it is queued.
"""

from __future__ import annotations

import msgspec

from deepserve.errors import InvalidRequestError


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling and stopping.

    temperature: 0 means greedy; >0 divides the logits before softmax.
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    top_p: nucleus mass in (0, 1]; 1 keeps all.
    seed: a per-request generator seed; the same seed gives the same output.
    max_tokens: how many tokens to generate at most (>= 1).
    stop: strings that end generation; the stop string is not in the text.
    stop_token_ids: token ids that end generation (in addition to EOS).
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: None for none; N >= 0 returns the sampled token's logprob and
        the N most likely alternatives at each step.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError for the first bad field; return self."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or >= 1, got {self.top_k}", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        return self
