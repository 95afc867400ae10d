"""SamplingParams: how one request wants its tokens chosen and when to stop.

It is a msgspec Struct because it travels (gateway -> job executor -> TE
master -> workers); `validate()` raises InvalidRequestError naming the field,
so every entry point rejects bad input the same way before it is queued.
"""

from __future__ import annotations

import math

import msgspec

from deepserve.errors import InvalidRequestError

# Temperatures below this are greedy (argmax), as in vLLM: dividing float32
# logits by 1e-300 (0 in float32) or a denormal would make NaN. See sampler.py.
TEMPERATURE_EPSILON = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator takes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling and stopping.

    Every value validate() accepts is numerically safe (no NaN, no dead
    worker); the clamps, as in the OpenAI API and vLLM:

    temperature: finite, >= 0. Below TEMPERATURE_EPSILON (1e-5; so 0, 1e-8,
        1e-300, 5e-324) means greedy, the argmax exactly; above, it divides
        the logits before softmax. No upper bound here (the HTTP API caps at 2).
    top_k: keep the k most likely tokens; 0 or -1 keeps all, as does k >= vocab.
    top_p: nucleus mass in (0, 1]; 1 keeps all. The most likely token is
        always kept, so a top_p smaller than its probability (1e-300, 5e-324)
        keeps exactly that token.
    seed: a per-request generator seed in [-2**63, 2**64); the same seed gives
        the same output.
    max_tokens: how many tokens to generate at most (>= 1).
    stop: strings that end generation; the stop string is not in the text.
    stop_token_ids: token ids that end generation (in addition to EOS).
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: None for none; N >= 0 returns the sampled token's logprob and
        the N most likely alternatives at each step. Logprobs are never -inf
        or NaN: a token of (near) zero probability reports -9999.0.
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
        return self.temperature < TEMPERATURE_EPSILON

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError for the first bad field; return self."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}",
                "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or >= 1, got {self.top_k}", "top_k")
        if self.seed is not None and not (isinstance(self.seed, int)
                                          and SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", "seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        return self
