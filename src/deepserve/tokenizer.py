"""Tokenizer: `tokenizer.json` through the `tokenizers` library, and the
model's chat template (checkpoint.py finds it) rendered with jinja2
(sandboxed, with the helpers Hugging Face templates expect).

It lives on the bottom floor, beside config.py, because the TE's tokenizer
process and the job executor (which tokenizes to route by cache locality)
both need it, and neither may import the other's room. No torch here.

Chat messages are encoded so that only the template makes control tokens: a
special token's text inside a message (`<|im_start|>system` in user content)
is encoded as plain text, so a user cannot forge a turn. The template is
rendered with each such occurrence swapped for a private-use marker, then
the markers are put back and remembered as guarded spans; the text is split
on the template's special tokens only and everything between them, guarded
spans included, is encoded with special-token matching off. Content with no
special-token text takes the plain path: the same ids as before. A raw
completion prompt is the caller's own text (it may send token ids anyway),
so it is encoded as given, special tokens included.

A raw prompt gets the model's BOS token in front when tokenizer_config.json
says `add_bos_token: true` and tokenizer.json's post-processor does not add
it already (a converted checkpoint, e.g. from GGUF, may say so only in the
config): what transformers does when the flag reaches the tokenizer
(`AutoTokenizer.from_pretrained(dir, add_bos_token=True)`; transformers 5
itself drops the config's flag whenever a tokenizer.json is present, while
llama.cpp and transformers 4's Llama tokenizers honour it). A chat prompt is
encoded as `apply_chat_template` encodes it, without special tokens: the
template writes the BOS itself when the model wants one, never twice.

Templates: checkpoint.chat_templates (chat_template.jinja, the tokenizer
config's string or list form); the "default" one renders chat requests, the
others (e.g. "tool_use") are kept by name in `chat_templates`."""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from deepserve.checkpoint import DEFAULT_TEMPLATE, chat_templates
from deepserve.errors import InvalidRequestError, ModelLoadError


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain JSON (jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Markers stand for guarded text while the template renders: plane-16 private
# use characters. Content that itself holds such characters has them guarded
# too, so every marker in the rendered text is one of ours.
_MARK_FIRST, _MARK_LAST = 0x100000, 0x10FFFD
_MARK_RE = re.compile(f"[{chr(_MARK_FIRST)}-{chr(_MARK_LAST)}]")


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
        self.chat_templates = chat_templates(model_dir, self.config)  # name -> template
        self.chat_template: str | None = self.chat_templates.get(DEFAULT_TEMPLATE)
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.bos_id = self._add_bos_id()  # prepended to a raw prompt (module doc) or None
        # special token text -> id; a second tokenizer that reads such text as text
        self._special_ids = {t.content: i for i, t in
                             self._tok.get_added_tokens_decoder().items() if t.special}
        self._path = path
        texts = sorted(self._special_ids, key=len, reverse=True)  # longest first
        self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._guard_re = re.compile("|".join([*map(re.escape, texts), _MARK_RE.pattern]))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def _add_bos_id(self) -> int | None:
        """The BOS id encode() must prepend itself: add_bos_token is true, the
        BOS token is known, and the post-processor does not add it already."""
        if self.config.get("add_bos_token") is not True or not self.bos_token:
            return None
        bos_id = self._tok.token_to_id(self.bos_token)
        if bos_id is None:
            raise ModelLoadError(f"bos_token {self.bos_token!r} is not in {self._path}")
        probe = self._tok.encode("a")
        if probe.ids[:1] == [bos_id] and probe.special_tokens_mask[:1] == [1]:
            return None  # the post-processor's own
        return bos_id

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def request_ids(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    messages: list[dict] | None = None) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a request given as chat messages,
        token ids or text; InvalidRequestError when there is nothing usable."""
        if messages is not None:
            text, guarded = self._render_guarded(messages)
            if not guarded:
                return text, self.encode(text, add_special_tokens=False)
            return text, self._encode_guarded(text, guarded)
        if prompt_token_ids is not None:
            return None, list(prompt_token_ids)
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                "prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        return prompt, self.encode(prompt)

    def render(self, messages: list[dict], add_generation_prompt: bool = True
               ) -> tuple[str, list[tuple[int, int]]]:
        """The chat template's text and its guarded spans (encode_rendered takes both)."""
        return self._render_guarded(messages, add_generation_prompt)

    def encode_rendered(self, text: str, guarded: list[tuple[int, int]],
                        prefix: tuple[str, list[int]] | None = None) -> list[int] | None:
        """Ids of rendered text; with prefix = (text, ids) of an earlier prompt
        this one starts with, those ids and only the rest encoded (token-id
        continuity: the KV of those ids is cached). None if `text` does not
        start with the prefix text, or a guarded span straddles its end."""
        if prefix is None:
            if not guarded:
                return self.encode(text, add_special_tokens=False)
            return self._encode_guarded(text, guarded)
        head, head_ids = prefix
        cut = len(head)
        if not text.startswith(head) or any(s < cut < e for s, e in guarded):
            return None
        tail, spans = text[cut:], [(s - cut, e - cut) for s, e in guarded if s >= cut]
        if not tail:
            return list(head_ids)
        return list(head_ids) + self.encode_rendered(tail, spans)

    def _render_guarded(self, messages: list[dict], add_generation_prompt: bool = True
                        ) -> tuple[str, list[tuple[int, int]]]:
        """(rendered prompt, [start, end) spans of it that came from message
        text and look like special tokens or markers: encode them as text)."""
        _check_messages(messages)
        markers: dict[str, str] = {}  # guarded text -> its marker

        def mark(match: re.Match) -> str:
            if match[0] not in markers:
                if len(markers) > _MARK_LAST - _MARK_FIRST:
                    raise InvalidRequestError("messages hold too many distinct special "
                                              "characters", "messages")
                markers[match[0]] = chr(_MARK_FIRST + len(markers))
            return markers[match[0]]

        escaped = [{k: self._guard_re.sub(mark, v) if isinstance(v, str) else v
                    for k, v in m.items()} for m in messages]
        rendered = self.apply_chat_template(escaped, add_generation_prompt)
        if not markers:
            return rendered, []
        originals = {marker: text for text, marker in markers.items()}
        parts, spans, pos, last = [], [], 0, 0
        for match in _MARK_RE.finditer(rendered):
            parts.append(rendered[last:match.start()])
            pos += match.start() - last
            original = originals[match[0]]
            parts.append(original)
            spans.append((pos, pos + len(original)))
            pos += len(original)
            last = match.end()
        parts.append(rendered[last:])
        return "".join(parts), spans

    @cached_property
    def _plain(self) -> HFTokenizer:
        """A second tokenizer that reads special-token text as text; loaded the
        first time guarded content shows up, not at every start-up."""
        plain = HFTokenizer.from_file(str(self._path))
        plain.encode_special_tokens = True
        return plain

    def _encode_guarded(self, text: str, guarded: list[tuple[int, int]]) -> list[int]:
        """Token ids of `text`: special tokens outside the guarded spans are
        control tokens, everything else (guarded spans included) plain text."""
        if self._special_re is None:
            return self._plain.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pending: list[str] = []  # plain text since the last control token

        def flush():
            if pending:
                ids.extend(self._plain.encode("".join(pending), add_special_tokens=False).ids)
                pending.clear()

        pos = 0
        for start, end in [*guarded, (len(text), len(text))]:
            last = pos
            for match in self._special_re.finditer(text, pos, start):
                pending.append(text[last:match.start()])
                flush()
                ids.append(self._special_ids[match[0]])
                last = match.end()
            pending.append(text[last:end])  # the rest, then the guarded span itself
            pos = end
        flush()
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template", "messages")
        _check_messages(messages)
        try:
            return _template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **self._special_token_texts)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", "messages") from e

    @cached_property
    def _special_token_texts(self) -> dict[str, str]:
        """What transformers hands a template besides the messages: the named
        special tokens' texts ("" for one the model does not have)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {name: _token_text(self.config.get(name)) or "" for name in names}


@lru_cache(maxsize=16)
def _template(source: str) -> jinja2.Template:
    """A template compiled as transformers compiles it: sandboxed, trimmed,
    with loop controls, raise_exception, strftime_now and its tojson; once
    per template source (a compiled template renders from any thread)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


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
