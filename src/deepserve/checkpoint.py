"""What a Hugging Face checkpoint says beside its weights: its chat templates
and its generation defaults, read without torch.

It lives on the bottom floor, beside tokenizer.py, because the TE's
tokenizer process, its master and the in-process engine all resolve a
request against the same files, and the job executor reads them too.

Chat templates, found as transformers finds them: `chat_template.jinja`
(what current transformers saves) is the "default" template and
`additional_chat_templates/NAME.jinja` the others; when any such file exists
it replaces whatever tokenizer_config.json says. Otherwise the tokenizer
config's `chat_template`: a string is the default, a list of {"name",
"template"} keeps every template by its name ("default", "tool_use", ...).

Generation defaults, as vLLM applies them by default (`--generation-config
auto`): temperature, top_p, top_k, repetition_penalty and max_new_tokens
from generation_config.json fill the fields a request leaves unset; the
request's own value always wins. `do_sample` is not read (vLLM does not
either): a model that ships a temperature samples with it. max_new_tokens
(vLLM's max_tokens) is capped by what is left of the context; with none, an
unset max_tokens is all of what is left (max_model_len - prompt tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from deepserve.errors import InvalidRequestError, ModelLoadError
from deepserve.messages.sampling import SamplingParams

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
DEFAULT_TEMPLATE = "default"
GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""generation_config.json key -> the SamplingParams field it is the default of."""


def chat_templates(model_dir: str | Path, tokenizer_config: Mapping) -> dict[str, str]:
    """Template name -> jinja source (module doc); {} when the model has none.
    ModelLoadError when a template in the tokenizer config is malformed."""
    model_dir = Path(model_dir)
    found = {}
    default = model_dir / CHAT_TEMPLATE_FILE
    if default.is_file():
        found[DEFAULT_TEMPLATE] = default.read_text(encoding="utf-8")
    extra = model_dir / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if found:
        return found
    return _config_templates(tokenizer_config.get("chat_template"), model_dir)


def _config_templates(value, model_dir: Path) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE: value}
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ModelLoadError(f"{model_dir / 'tokenizer_config.json'}: chat_template must be a "
                         "string or a list of {\"name\", \"template\"} objects")


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's sampling defaults: SamplingParams field -> value (only the
    fields its generation_config.json sets; max_tokens from max_new_tokens)."""

    values: Mapping[str, float | int] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    @classmethod
    def load(cls, model_dir: str | Path) -> "GenerationDefaults":
        """The defaults of `model_dir` (none without generation_config.json);
        ModelLoadError naming the file and key for a value no request could
        have (a negative temperature, a top_p of 2)."""
        path = Path(model_dir) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path} cannot be read: {e}") from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} is not a JSON object")
        values = {name: _integral(raw[key]) for key, name in GENERATION_FIELDS.items()
                  if raw.get(key) is not None}
        try:
            SamplingParams(**values).validate()
        except (InvalidRequestError, TypeError) as e:
            raise ModelLoadError(f"{path}: {e}") from e
        return cls(values)

    def apply(self, sampling: SamplingParams, num_prompt_tokens: int, max_model_len: int,
              num_resumed: int = 0) -> SamplingParams:
        """`sampling` with every unset field resolved: the model's default,
        else the built-in one; max_tokens: max_new_tokens (less the
        `num_resumed` output tokens an earlier attempt made, which are in the
        prompt now) capped by the context left, else all of the context left.
        Never below 1: a prompt with no room left is check_request's to refuse."""
        if sampling.is_resolved:
            return sampling
        room = max(1, max_model_len - num_prompt_tokens)
        max_new = self.values.get("max_tokens")
        max_tokens = room if max_new is None else max(1, min(room, max_new - num_resumed))
        return sampling.with_defaults({**self.values, "max_tokens": max_tokens})


def _integral(value):
    """5.0 -> 5 (a JSON writer may spell an integer so); anything else as is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
