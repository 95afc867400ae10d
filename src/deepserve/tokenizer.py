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
others (e.g. "tool_use") are kept by name in `chat_templates`.

token_bytes(id): the exact bytes one token stands for (logprobs' `bytes`),
read off tokenizer.json's decoder: a byte-level vocabulary (decoder
ByteLevel: GPT-2, SmolLM2, Qwen, Llama 3) spells each byte with one
character of GPT-2's byte <-> unicode table; a sentencepiece-style one
(Metaspace, or Replace "▁" -> " ": Llama 2, Mistral, Gemma) spells a space
"▁" and, with a ByteFallback decoder, a raw byte <0xNN>; added (special)
tokens are their content. Any other decoder: the UTF-8 of decode([id]). A
token's leading space is kept (decode() strips it at the start of a text),
as vLLM shows it."""

from __future__ import annotations

import json
import re
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from deepserve import chat_template
from deepserve.checkpoint import DEFAULT_TEMPLATE, chat_templates
from deepserve.errors import InvalidRequestError, ModelLoadError


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
        self._path = path
        self.bos_id = self._add_bos_id()  # prepended to a raw prompt (module doc) or None
        # special token text -> id; a second tokenizer that reads such text as text
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = {t.content: i for i, t in added.items() if t.special}
        texts = sorted(self._special_ids, key=len, reverse=True)  # longest first
        self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._guard_re = re.compile("|".join([*map(re.escape, texts), _MARK_RE.pattern]))
        self._added = {i: t.content for i, t in added.items()}  # id -> text (token_bytes)
        self._bytes: dict[int, bytes] = {}  # token_bytes' cache

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for an id (as spelled there: "Ġhi", "▁hi")."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (module doc); b"" for an id the
        vocabulary does not have. Cached: logprobs ask for the same ids often."""
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._spell_bytes(token_id)
        return found

    def _spell_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tok.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return b""
        kind, space, byte_fallback = self._spelling
        if kind == "byte_level":
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif kind == "sentencepiece":
            byte = _BYTE_PIECE.fullmatch(piece) if byte_fallback else None
            return bytes([int(byte[1], 16)]) if byte else piece.replace(space, " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    @cached_property
    def _spelling(self) -> tuple[str, str, bool]:
        """(kind, space marker, <0xNN> pieces are bytes) from tokenizer.json's
        decoder; kind "byte_level", "sentencepiece" or "text" (module doc)."""
        decoder = self._tok.decoder
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
        parts = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
        types = {part.get("type") for part in parts}
        if "ByteLevel" in types:
            return "byte_level", "", False
        for part in parts:
            pattern = part.get("pattern")
            if part.get("type") == "Metaspace":
                space = part.get("replacement") or _SPACE_MARK
            elif part.get("type") == "Replace" and part.get("content") == " " \
                    and isinstance(pattern, dict) and pattern.get("String"):
                space = pattern["String"]
            else:
                continue
            return "sentencepiece", space, "ByteFallback" in types
        return "text", "", False

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
                    messages: list[dict] | None = None, chat_options: dict | None = None
                    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a request given as chat messages
        (rendered with chat_options: render's), token ids or text;
        InvalidRequestError when there is nothing usable."""
        if messages is not None:
            text, guarded = self._render_guarded(messages, **(chat_options or {}))
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

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **options
               ) -> tuple[str, list[tuple[int, int]]]:
        """The chat template's text and its guarded spans (encode_rendered
        takes both); options: chat_template.render's (tools, ...)."""
        return self._render_guarded(messages, add_generation_prompt, **options)

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

    def _render_guarded(self, messages: list[dict], add_generation_prompt: bool = True,
                        **options) -> tuple[str, list[tuple[int, int]]]:
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

        def guard(value):  # every string, however deep (tool calls, tools' schemas)
            if isinstance(value, str):
                return self._guard_re.sub(mark, value)
            if isinstance(value, dict):
                return {guard(k): guard(v) for k, v in value.items()}
            if isinstance(value, list):
                return [guard(v) for v in value]
            return value

        rendered = self.apply_chat_template(guard(messages), add_generation_prompt,
                                            **guard(options))
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **options) -> str:
        """options: chat_template.render's (tools, continue_final_message,
        template_kwargs)."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template", "messages")
        _check_messages(messages)
        return chat_template.render(self.chat_template, messages, self._special_token_texts,
                                    add_generation_prompt, **options)

    @cached_property
    def _special_token_texts(self) -> dict[str, str]:
        """What transformers hands a template besides the messages: the named
        special tokens' texts ("" for one the model does not have)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {name: _token_text(self.config.get(name)) or "" for name in names}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"  # sentencepiece's "▁"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte <-> unicode table, read backwards: printable Latin-1
    bytes are spelled as themselves, the other bytes as 256, 257, ... in order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(others)}}


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
