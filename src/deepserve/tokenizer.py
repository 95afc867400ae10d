"""Tokenizer: `tokenizer.json` through the `tokenizers` library, and the chat
template from `tokenizer_config.json` rendered with jinja2 (sandboxed, with
the helpers Hugging Face templates expect).

It lives on the bottom floor, beside config.py, because the TE's tokenizer
process and the job executor (which tokenizes to route by cache locality)
both need it, and neither may import the other's room. No torch here."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from deepserve.errors import InvalidRequestError, ModelLoadError


def _raise(message: str):
    raise jinja2.TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{str(model_dir)!r} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception
            raise ModelLoadError(f"{path} cannot be read: {e}") from e
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def request_ids(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    messages: list[dict] | None = None) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a request given as chat messages,
        token ids or text; InvalidRequestError when there is nothing usable."""
        if messages is not None:
            text = self.apply_chat_template(messages)
            return text, self.encode(text, add_special_tokens=False)
        if prompt_token_ids is not None:
            return None, list(prompt_token_ids)
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                "prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        return prompt, self.encode(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template", "messages")
        _check_messages(messages)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", "messages") from e


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise InvalidRequestError(
                f"messages[{i}] must have a string 'role' and a string 'content'", "messages")
