"""checkpoint.py: where chat templates are found, and how generation_config.json
fills the sampling fields a request leaves unset (the request always wins)."""

from __future__ import annotations

import json

import pytest

from deepserve.checkpoint import GenerationDefaults, chat_templates
from deepserve.errors import ModelLoadError
from deepserve.messages.sampling import BUILTIN_DEFAULTS, SamplingParams


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# -- chat templates -------------------------------------------------------------------
def test_template_files_win_over_the_tokenizer_config(tmp_path):
    _write(tmp_path / "chat_template.jinja", "file {{ messages }}")
    _write(tmp_path / "additional_chat_templates" / "tool_use.jinja", "tools")
    found = chat_templates(tmp_path, {"chat_template": "config"})
    assert found == {"default": "file {{ messages }}", "tool_use": "tools"}


def test_the_list_form_keeps_every_template_by_name(tmp_path):
    config = {"chat_template": [{"name": "default", "template": "d"},
                                {"name": "tool_use", "template": "t"},
                                {"name": "rag", "template": "r"}]}
    assert chat_templates(tmp_path, config) == {"default": "d", "tool_use": "t", "rag": "r"}


def test_a_string_is_the_default_and_none_is_no_template(tmp_path):
    assert chat_templates(tmp_path, {"chat_template": "s"}) == {"default": "s"}
    assert chat_templates(tmp_path, {}) == {}


@pytest.mark.parametrize("bad", [5, [{"name": "default"}], [{"template": "t"}], ["t"]])
def test_a_malformed_template_entry_is_a_load_error(tmp_path, bad):
    with pytest.raises(ModelLoadError, match="chat_template"):
        chat_templates(tmp_path, {"chat_template": bad})


# -- generation defaults ----------------------------------------------------------------
def _defaults(tmp_path, **config) -> GenerationDefaults:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return GenerationDefaults.load(tmp_path)


def test_the_sampling_keys_are_read_and_the_rest_ignored(tmp_path):
    got = _defaults(tmp_path, temperature=0.6, top_p=0.95, top_k=20.0, repetition_penalty=1.1,
                    max_new_tokens=64, do_sample=True, eos_token_id=[1, 2], min_p=None)
    assert dict(got.values) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                "repetition_penalty": 1.1, "max_tokens": 64}
    assert isinstance(got.values["top_k"], int)  # 20.0 is an integer in JSON
    assert dict(GenerationDefaults.load(tmp_path / "nowhere").values) == {}


@pytest.mark.parametrize("key,value,field", [
    ("temperature", -1, "temperature"), ("top_p", 2.0, "top_p"), ("top_k", -5, "top_k"),
    ("repetition_penalty", 0, "repetition_penalty"), ("max_new_tokens", 0, "max_tokens"),
    ("temperature", "hot", "temperature")])
def test_a_value_no_request_could_have_is_a_load_error_naming_it(tmp_path, key, value, field):
    with pytest.raises(ModelLoadError, match=f"generation_config.json: {field}"):
        _defaults(tmp_path, **{key: value})


def test_unset_fields_take_the_model_default_and_set_ones_win(tmp_path):
    model = _defaults(tmp_path, temperature=0.0, top_k=5, max_new_tokens=5)
    omitted = model.apply(SamplingParams(), num_prompt_tokens=10, max_model_len=100)
    assert (omitted.temperature, omitted.top_k, omitted.max_tokens) == (0.0, 5, 5)
    assert (omitted.top_p, omitted.repetition_penalty) == (BUILTIN_DEFAULTS["top_p"],
                                                           BUILTIN_DEFAULTS["repetition_penalty"])
    assert omitted.is_resolved and omitted.is_greedy
    own = model.apply(SamplingParams(temperature=1.0, top_k=0, max_tokens=7), 10, 100)
    # equal to the built-in defaults, and set: they win over the model's
    assert (own.temperature, own.top_k, own.max_tokens) == (1.0, 0, 7)


def test_max_tokens_is_the_context_left_capped_by_max_new_tokens(tmp_path):
    none = GenerationDefaults()
    assert none.apply(SamplingParams(), 30, 100).max_tokens == 70
    capped = _defaults(tmp_path, max_new_tokens=50)
    assert capped.apply(SamplingParams(), 30, 100).max_tokens == 50
    assert capped.apply(SamplingParams(), 80, 100).max_tokens == 20  # the context is smaller
    # a resumed attempt's prompt holds 12 outputs already: 38 of the 50 are left
    assert capped.apply(SamplingParams(), 42, 100, num_resumed=12).max_tokens == 38
    assert capped.apply(SamplingParams(), 99, 100, num_resumed=60).max_tokens == 1
    assert none.apply(SamplingParams(), 200, 100).max_tokens == 1  # check_request refuses it


def test_a_resolved_request_is_left_as_it_is(tmp_path):
    resolved = GenerationDefaults().apply(SamplingParams(), 3, 10)
    assert _defaults(tmp_path, temperature=0.1).apply(resolved, 3, 10) is resolved
