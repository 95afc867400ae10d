"""Checks on a request's prompt, done before it enters the batch."""

from __future__ import annotations

from deepserve.errors import InvalidRequestError, PromptTooLongError


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not ids:
        raise InvalidRequestError("prompt is empty (no tokens)", "prompt")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})",
                                  "prompt")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}, which must leave "
            f"room for at least one generated token", "prompt")
