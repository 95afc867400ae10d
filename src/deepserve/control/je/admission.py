"""The job executor's bounded tokenization: refuse what cannot fit, tokenize once.

    JE._submit ──PromptTokens.ids(msg)──> char bound? ──> cache hit? ──> Tokenizer.request_ids

The JE has one thread; a 1M-character prompt must not hold it for long, nor
n times for a request with n choices (the gateway sends n sub-requests,
`{request_id}-{i}`, with the same prompt):

- char bound: a prompt of more characters than max_model_len x the longest
  token of the vocabulary (in characters) cannot fit the model, whatever it
  says: refused (PromptTooLongError naming `prompt` / `messages`) without
  tokenizing. A byte-level vocabulary spells a token with one character per
  byte, so that length bounds the characters of text one token can stand
  for. A normalizer may shorten text before it is tokenized (NFC composes
  up to 3 characters into 1), so the bound is 3x with NFC/NFKC/NFD/NFKD and
  off with any other normalizer (it could delete characters).
- tokenize once: the last CACHE_SIZE tokenizations are kept for CACHE_TTL_S,
  by the request's content (prompt or messages), so the n sub-requests of
  one request, arriving back to back, tokenize once.

Pure Python, no I/O after construction.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import msgspec

from deepserve.errors import PromptTooLongError
from deepserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
CACHE_SIZE, CACHE_TTL_S = 8, 5.0
_SHRINKING = {"NFC": 3, "NFKC": 3, "NFD": 3, "NFKD": 3}
"""Normalizers that may shorten text, and by how much at most (module doc)."""


def max_token_chars(model_dir: str | Path) -> int | None:
    """Characters one token may stand for at most (times the normalizer's
    shrink factor); None when no bound is safe (an unknown normalizer)."""
    try:
        spec = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    factor = _shrink_factor(spec.get("normalizer"))
    vocab = (spec.get("model") or {}).get("vocab") or {}
    texts = list(vocab) if isinstance(vocab, dict) else [v[0] for v in vocab if v]
    texts += [t.get("content", "") for t in spec.get("added_tokens") or []]
    if factor is None or not texts:
        return None
    return factor * max(len(t) for t in texts)


def _shrink_factor(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factors = [_shrink_factor(n) for n in normalizer.get("normalizers") or []]
        if any(f is None for f in factors):
            return None
        product = 1
        for f in factors:
            product *= f
        return product
    return _SHRINKING.get(kind)


def model_max_len(model_dir: str | Path) -> int | None:
    """The model's max_position_embeddings (no TE serves a longer sequence)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def num_chars(msg) -> tuple[int, str]:
    """(characters of the request's text, the field that holds it)."""
    if msg.messages is not None:
        return sum(len(s) for s in _strings(msg.messages)), "messages"
    return (len(msg.prompt) if isinstance(msg.prompt, str) else 0), "prompt"


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


class PromptTokens:
    """A request's prompt ids, bounded (char bound) and cached (module doc)."""

    def __init__(self, tokenizer: Tokenizer, max_chars: int | None,
                 clock: Callable[[], float] = time.monotonic, max_len: int | None = None):
        self.tokenizer, self.max_chars, self.clock = tokenizer, max_chars, clock
        self.max_len = max_len  # the model's context (max_position_embeddings), if known
        self._cache: OrderedDict[bytes, tuple[float, str | None, list[int]]] = OrderedDict()
        self.num_tokenized = 0

    @classmethod
    def for_model(cls, model_dir: str | Path, tokenizer: Tokenizer,
                  max_model_len: int | None = None) -> "PromptTokens":
        max_len = max_model_len or model_max_len(model_dir)
        per_token = max_token_chars(model_dir)
        max_chars = max_len * per_token if max_len and per_token else None
        return cls(tokenizer, max_chars, max_len=max_len)

    def check_chars(self, msg) -> None:
        """PromptTooLongError when the text cannot fit the model (the char bound)."""
        chars, field = num_chars(msg)
        if self.max_chars is not None and chars > self.max_chars:
            raise PromptTooLongError(
                f"{field} has {chars} characters: more tokens than the model's maximum "
                f"context length can hold", field)

    def ids(self, msg) -> list[int]:
        """The prompt ids of a SubmitRequest; InvalidRequestError (or
        PromptTooLongError) naming the field when unusable."""
        if msg.messages is None and msg.prompt_token_ids is not None:
            return list(msg.prompt_token_ids)
        self.check_chars(msg)
        chat = getattr(msg, "chat", None)
        options = chat.render_options() if chat is not None else None
        _, ids = self.memo(msg, lambda: self.tokenizer.request_ids(msg.prompt, None,
                                                                   msg.messages, options),
                           scope=options)
        return ids

    def memo(self, msg, compute, scope=None) -> tuple[str | None, list[int]]:
        """compute() -> (text, ids), done once for the same content, context
        and scope (the tenant: continuity differs per tenant) within
        CACHE_TTL_S: the n sub-requests of one request."""
        key = msgspec.msgpack.encode([msg.prompt, msg.messages,
                                      getattr(msg, "context_id", None), scope])
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] <= CACHE_TTL_S:
            self._cache.move_to_end(key)
            return hit[1], list(hit[2])
        text, ids = compute()
        self.num_tokenized += 1
        self._cache[key] = (now, text, ids)
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return text, list(ids)
