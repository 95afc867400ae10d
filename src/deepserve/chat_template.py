"""A model's chat template rendered as transformers renders it: sandboxed
jinja2, trimmed blocks, loop controls, raise_exception, strftime_now and
transformers' tojson, with the named special tokens' texts, the messages,
and what the request adds (apply_chat_template's own keywords):

- tools: OpenAI tool dicts, for templates that render them (`tools`);
- add_generation_prompt: open the assistant's turn (default true);
- continue_final_message: render the last message open-ended, so the model
  continues it (the text is cut right after that message's content, as
  transformers does); it excludes add_generation_prompt;
- chat_template_kwargs: the client's own variables (e.g. enable_thinking).
  They may not replace the names above nor the special tokens' texts
  (RESERVED): a 400 names the key.

Pure: the tokenizer guards special-token text in message content before it
calls this, so nothing a client writes becomes a control token.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deepserve.errors import InvalidRequestError

RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "bos_token", "eos_token", "unk_token",
                      "pad_token", "raise_exception", "strftime_now"})
MAX_TEMPLATE_KWARGS = 32
"""chat_template_kwargs keys of one request at most."""


def render(source: str, messages: list[dict], special_texts: dict[str, str],
           add_generation_prompt: bool = True, tools: list[dict] | None = None,
           continue_final_message: bool = False,
           template_kwargs: dict | None = None) -> str:
    """The template's text; InvalidRequestError (naming the field) when the
    options conflict or the template refuses the messages."""
    kwargs = check_template_kwargs(template_kwargs)
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot "
                                  "both be true", "continue_final_message")
    try:
        text = _template(source).render(
            **kwargs, **special_texts, messages=messages, tools=tools or None,
            add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"chat template rejected the messages: {e}", "messages") from e
    if continue_final_message:
        return _open_ended(text, messages[-1].get("content"))
    return text


def check_template_kwargs(template_kwargs: dict | None) -> dict:
    if not template_kwargs:
        return {}
    if not isinstance(template_kwargs, dict) or len(template_kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequestError(f"chat_template_kwargs must be an object of at most "
                                  f"{MAX_TEMPLATE_KWARGS} keys", "chat_template_kwargs")
    for key in template_kwargs:
        if not isinstance(key, str) or not key.isidentifier() or key in RESERVED:
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}",
                                      "chat_template_kwargs")
    return dict(template_kwargs)


def _open_ended(text: str, content) -> str:
    """text cut right after the final message's content (transformers' rule)."""
    final = content.strip() if isinstance(content, str) else ""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise InvalidRequestError("continue_final_message needs a final message whose "
                                  "content the template renders", "continue_final_message")
    return text[:at + len(final)]


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain JSON (jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _template(source: str) -> jinja2.Template:
    """Compiled once per template source (a compiled template renders from
    any thread)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    return env.from_string(source)
