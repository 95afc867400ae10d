"""Incremental detokenization that never splits a UTF-8 character.

Byte-level tokens can end in the middle of a multi-byte character; decoding
such a prefix yields U+FFFD. We decode a small window of recent tokens and
release text only when it does not end in U+FFFD, so the pieces concatenate
to exactly `decode(all output tokens)` (flush() releases a genuinely broken
tail at the end).
"""

from __future__ import annotations

from deepserve.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens kept for tokenizers whose decode depends on a left context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # tokens before this are already text
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one output token; return the new text it completes ('' if none)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: release whatever is held back, broken bytes included."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)
