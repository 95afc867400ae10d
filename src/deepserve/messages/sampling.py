"""SamplingParams: how one request wants its tokens chosen and when to stop.

It is a msgspec Struct because it travels (gateway -> job executor -> TE
master -> workers); `validate()` raises InvalidRequestError naming the field,
so every entry point rejects bad input the same way before it is queued.

Five fields may be *unset* (None): temperature, top_k, top_p,
repetition_penalty and max_tokens. The gateway sends only what the client
set (None is the default, so omit_defaults leaves it off the wire), because
an unset field takes the model's own default (generation_config.json) and
only the TE knows its model: the TE resolves a request once, where it enters
(checkpoint.GenerationDefaults.apply), and everything after that (the
scheduler, PD's prefill order, the workers' sampler) sees concrete values.
A value the client set always wins, even one equal to the built-in default.
"""

from __future__ import annotations

import math
from typing import Mapping

import msgspec

from deepserve.errors import InvalidRequestError

# Temperatures below this are greedy (argmax), as in vLLM: dividing float32
# logits by 1e-300 (0 in float32) or a denormal would make NaN. See sampler.py.
TEMPERATURE_EPSILON = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator takes

BUILTIN_DEFAULTS: Mapping[str, float | int] = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
"""What an unset field means when the model sets no default either (as in
vLLM and the OpenAI API). An unset max_tokens has no constant default: it is
the rest of the context (GenerationDefaults.apply)."""
DEFAULTABLE = (*BUILTIN_DEFAULTS, "max_tokens")
"""The fields that may be unset on the wire (module doc)."""
MAX_LOGIT_BIAS = 1024
"""logit_bias entries of one request at most."""
MAX_BAD_WORDS = 64
"""bad_words of one request at most."""


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
"""What a StructuredOutput may be (messages/sampling.py StructuredOutput)."""


class StructuredOutput(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A grammar the output must follow, as the client gave it.

    kind: "json" (spec: a JSON schema, as JSON text), "json_object" (any
    JSON object; spec unused), "regex" (spec: the pattern), "choice" (spec: a
    JSON list of strings: exactly one of them), "grammar" (spec: EBNF, GBNF
    style) or "structural_tag" (spec: xgrammar's structural tag, as JSON).
    The worker compiles it (cached by (kind, spec)) and masks every token the
    grammar cannot take next; a grammar that has ended allows only EOS.
    compact: JSON output without whitespace between tokens.
    field: the request field it came from (response_format, guided_json, ...),
        which an error about it names.
    num_replayed: trailing prompt tokens that are output already (a resumed
    attempt's): the grammar accepts them before the first sampled token."""

    kind: str
    spec: str = ""
    compact: bool = False
    field: str = "structured_outputs"
    num_replayed: int = 0


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
    repetition_penalty: finite, > 0; 1 is none. Hugging Face's rule over the
        prompt and generated token ids: a seen token's positive logit is
        divided by it, a negative one multiplied (worker/sampler.py).
    seed: a per-request generator seed in [-2**63, 2**64); the same seed gives
        the same output.
    max_tokens: how many tokens to generate at most (>= 1).
    stop: strings that end generation; the stop string is not in the text.
    stop_token_ids: token ids that end generation (in addition to EOS).
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: None for none; N >= 0 returns the sampled token's logprob and
        the N most likely alternatives at each step. Logprobs are never -inf
        or NaN: a token of (near) zero probability reports -9999.0.
    min_p: keep the tokens whose probability is at least min_p times the
        most likely one's (after temperature); 0 keeps all (HF's MinPLogitsWarper).
    presence_penalty / frequency_penalty: in [-2, 2], OpenAI's rule over the
        output tokens: a token's logit less presence if it occurred, less
        frequency times its count.
    logit_bias: token id -> a bias in [-100, 100] added to its logit.
    min_tokens: EOS and stop_token_ids are masked until this many tokens
        are out (one past max_tokens: none before max_tokens, which still ends
        the request).
    bad_words: words never generated (vLLM's rule: the last token of each
        tokenization of a word is masked where the tokens before it match);
        bad_words_ids: their token sequences, filled by the TE's tokenizer.
    prompt_logprobs: None for none; N >= 0 returns the logprob of every
        prompt token (after the first) under the model, with the N most
        likely alternatives (what evaluation harnesses read). Such a request
        shares no cached prefix: every prompt position is computed.
    include_stop_str_in_output: a stop string found is kept in the text.
    skip_special_tokens: special tokens are left out of the text (default).
    structured: a grammar the output must follow (StructuredOutput), or None.

    temperature, top_k, top_p, repetition_penalty and max_tokens: None is
    unset, resolved by the TE (module doc; with_defaults).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    bad_words: list[str] = []
    bad_words_ids: list[list[int]] = []
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature is not None and self.temperature < TEMPERATURE_EPSILON

    @property
    def is_resolved(self) -> bool:
        """No field is unset: what the scheduler and the sampler need."""
        return all(getattr(self, name) is not None for name in DEFAULTABLE)

    @property
    def has_repetition_penalty(self) -> bool:
        """The sampler must know the sequence's token ids (1 or unset: no)."""
        return self.repetition_penalty not in (None, 1.0)

    def with_defaults(self, defaults: Mapping[str, float | int]) -> "SamplingParams":
        """A copy whose unset fields take `defaults` (the model's), else
        BUILTIN_DEFAULTS; a field already set keeps its value. max_tokens
        stays unset unless `defaults` names it. Self when nothing changes."""
        filled = {name: defaults.get(name, BUILTIN_DEFAULTS.get(name))
                  for name in DEFAULTABLE if getattr(self, name) is None}
        filled = {name: value for name, value in filled.items() if value is not None}
        return msgspec.structs.replace(self, **filled) if filled else self

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError for the first bad field; return self.
        Unset fields are valid (the TE fills them)."""
        _check_number(self.temperature, "temperature", "a finite number >= 0",
                      lambda v: v >= 0)
        _check_number(self.top_p, "top_p", "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        _check_number(self.repetition_penalty, "repetition_penalty",
                      "a finite number > 0", lambda v: v > 0)
        if self.top_k is not None and not (_is_int(self.top_k) and self.top_k >= -1):
            raise InvalidRequestError(f"top_k must be -1, 0 or >= 1, got {self.top_k!r}", "top_k")
        if self.max_tokens is not None and not (_is_int(self.max_tokens)
                                                and self.max_tokens >= 1):
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", "seed")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= 20):
                raise InvalidRequestError(f"{name} must be between 0 and 20, got {value}", name)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        self._validate_extras(vocab_size)
        return self

    def _validate_extras(self, vocab_size: int | None) -> None:
        """The fields beyond OpenAI's core set (min_p .. structured)."""
        _check_number(self.min_p, "min_p", "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(getattr(self, name), name, "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            raise InvalidRequestError(
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias has more than {MAX_LOGIT_BIAS} entries", "logit_bias")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or (vocab_size is not None and not 0 <= token < vocab_size):
                raise InvalidRequestError(f"logit_bias token {token!r} is not in the "
                                          "vocabulary", "logit_bias")
            _check_number(bias, "logit_bias", "in [-100, 100]", lambda v: -100 <= v <= 100)
        if len(self.bad_words) > MAX_BAD_WORDS or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be at most {MAX_BAD_WORDS} non-blank "
                                      "strings", "bad_words")
        if vocab_size is not None and any(not 0 <= t < vocab_size
                                          for ids in self.bad_words_ids for t in ids):
            raise InvalidRequestError(f"bad_words_ids must be in [0, {vocab_size})", "bad_words")
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of "
                                      f"{', '.join(STRUCTURED_KINDS)}", "structured_outputs")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(value, field: str, what: str, is_in_range) -> None:
    """InvalidRequestError naming `field` unless value is None or a finite
    real number (not a bool) for which is_in_range holds."""
    if value is None:
        return
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and is_in_range(value)):
        raise InvalidRequestError(f"{field} must be {what}, got {value!r}", field)
