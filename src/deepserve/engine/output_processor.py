"""RequestState: one request's text, built token by token.

Used by the in-process engine and by the tokenizer process alike. It
detokenizes incrementally (special tokens left out unless the request's
skip_special_tokens is false), cuts the text at the first stop string (which
then finishes the request; the string itself stays with
include_stop_str_in_output), and holds back the last len(longest stop) - 1
characters while the request runs, so a stop string split across two
increments never reaches the caller.

A resumed attempt (its TE was lost mid-stream) starts from the ids the
caller already has tokens of: the last `resumed_output_ids` prompt ids are
output, detokenized here exactly as the first attempt did (same left
context), and the first `resumed_text_chars` characters of their text count
as emitted. So text the first attempt held back (a stop string's prefix, an
incomplete UTF-8 character) is emitted now, nothing is repeated, and a stop
string can match across the boundary.
"""

from __future__ import annotations

from deepserve.engine.detokenizer import IncrementalDetokenizer
from deepserve.tokenizer import Tokenizer
from deepserve.messages.sampling import SamplingParams


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling: SamplingParams, tokenizer: Tokenizer, resumed_output_ids: int = 0,
                 resumed_text_chars: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.token_ids: list[int] = []  # this attempt's
        self.finish_reason: str | None = None
        num_resumed = max(0, min(resumed_output_ids, len(prompt_token_ids)))
        num_context = len(prompt_token_ids) - num_resumed
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids[:num_context],
                                             sampling.skip_special_tokens)
        for token_id in prompt_token_ids[num_context:]:
            self._detok.push(token_id)
        self.text = self._detok.text  # the resumed output's, then this attempt's
        self._num_emitted = max(0, resumed_text_chars) if num_resumed else 0
        """Characters of text already handed out (by an earlier attempt too)."""
        self._holdback = max((len(s) for s in sampling.stop), default=1) - 1

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add_tokens(self, token_ids: list[int], finish_reason: str | None = None) -> str:
        """Append tokens (finish_reason set when the engine ended the request);
        return the text the caller may see now. A stop string found here sets
        finish_reason to "stop"."""
        if self.is_finished:
            return ""
        self.token_ids.extend(token_ids)
        for token_id in token_ids:
            self._detok.push(token_id)
        if finish_reason is not None:
            self._detok.flush()
        self.text = self._detok.text
        if self._cut_at_stop_string():
            finish_reason = "stop"
        self.finish_reason = finish_reason
        visible = len(self.text)
        if not self.is_finished:
            visible = max(self._num_emitted, visible - self._holdback)
        delta = self.text[self._num_emitted:visible]
        self._num_emitted = visible
        return delta

    def _cut_at_stop_string(self) -> bool:
        if not self.sampling.stop:
            return False
        start = max(0, self._num_emitted - self._holdback)
        hits = [(i, -len(s)) for s in self.sampling.stop for i in (self.text.find(s, start),)
                 if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the first; of those there, the longest
            self.text = self.text[:at - minus_len if self.sampling.include_stop_str_in_output
                                  else at]
        return bool(hits)
