"""Chat templates where current checkpoints keep them, and BOS as Hugging Face
adds it: each case is checked against transformers' own AutoTokenizer on the
same directory (the oracle), not against numbers written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepserve.errors import InvalidRequestError
from deepserve.tokenizer import Tokenizer

BOS = "<|endoftext|>"  # the tiny tokenizer's id 0
CHAT = [{"role": "system", "content": "Be brief <é>"}, {"role": "user", "content": "hi there"}]
BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n" \
               "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
ADD_BOS = {"type": "TemplateProcessing",  # what a Llama tokenizer.json says
           "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
           "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}}}


def _tokenizer_dir(tiny_model: Path, out: Path, post_processor=None, **config) -> Path:
    """The tiny model's tokenizer files, its tokenizer config updated (None deletes a key)."""
    out.mkdir()
    spec = json.loads((tiny_model / "tokenizer.json").read_text())
    spec["post_processor"] = post_processor
    (out / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(tiny_model / "special_tokens_map.json", out)
    cfg = {**json.loads((tiny_model / "tokenizer_config.json").read_text()), "bos_token": BOS}
    cfg.update(config)
    (out / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return out


def _hf(path: Path, **kwargs):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), **kwargs)


def _hf_chat_ids(hf, messages=CHAT) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))


# -- where the template is --------------------------------------------------------------
def test_chat_template_jinja_wins_over_the_tokenizer_config(tiny_model, tmp_path):
    path = _tokenizer_dir(tiny_model, tmp_path / "t")  # the config keeps its ChatML template
    (path / "chat_template.jinja").write_text(BOS_TEMPLATE)
    tok = Tokenizer(path)
    text, ids = tok.request_ids(messages=CHAT)
    hf = _hf(path)
    assert text == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith(BOS + "[system] Be brief <é>\n")
    assert ids == _hf_chat_ids(hf)


def test_the_list_form_renders_the_default_and_keeps_the_others(tiny_model, tmp_path):
    chatml = json.loads((tiny_model / "tokenizer_config.json").read_text())["chat_template"]
    path = _tokenizer_dir(tiny_model, tmp_path / "t", chat_template=[
        {"name": "tool_use", "template": "TOOLS {{ messages | length }}"},
        {"name": "default", "template": BOS_TEMPLATE}, {"name": "chatml", "template": chatml}])
    tok = Tokenizer(path)
    assert set(tok.chat_templates) == {"default", "tool_use", "chatml"}
    assert tok.chat_template == BOS_TEMPLATE
    hf = _hf(path)
    assert tok.request_ids(messages=CHAT)[1] == _hf_chat_ids(hf)
    assert hf.get_chat_template("tool_use") == tok.chat_templates["tool_use"]


def test_a_model_without_a_template_refuses_chat_with_a_400(tiny_model, tmp_path):
    tok = Tokenizer(_tokenizer_dir(tiny_model, tmp_path / "t", chat_template=None))
    assert tok.chat_templates == {}
    with pytest.raises(InvalidRequestError, match="this model has no chat template") as info:
        tok.request_ids(messages=CHAT)
    assert info.value.param == "messages"


def test_templates_get_the_helpers_transformers_gives_them(tiny_model, tmp_path):
    """tojson without HTML escapes, loop controls, strftime_now, raise_exception."""
    template = ("{% for m in messages %}{{ m | tojson }}{% if loop.index == 1 %}{% break %}"
                "{% endif %}{% endfor %}|{{ strftime_now('%Y') | length }}"
                "{% if messages | length > 5 %}{{ raise_exception('too long') }}{% endif %}")
    path = _tokenizer_dir(tiny_model, tmp_path / "t", chat_template=template)
    tok = Tokenizer(path)
    text = tok.apply_chat_template(CHAT)
    assert text == _hf(path).apply_chat_template(CHAT, add_generation_prompt=True,
                                                 tokenize=False)
    assert text == '{"role": "system", "content": "Be brief <é>"}|4'
    with pytest.raises(InvalidRequestError, match="too long"):
        tok.apply_chat_template(CHAT * 3)


# -- BOS --------------------------------------------------------------------------------------
@pytest.mark.parametrize("add_bos", [True, False, None])
@pytest.mark.parametrize("post_processor", [None, ADD_BOS], ids=["plain", "post-bos"])
def test_a_raw_prompt_gets_bos_as_hugging_face_adds_it(tiny_model, tmp_path, add_bos,
                                                       post_processor):
    """The oracle is AutoTokenizer with the config's flag handed to it: with
    add_bos_token true, transformers 5 alone drops the flag when tokenizer.json
    is present (checkpoints it saved carry BOS in the post-processor)."""
    path = _tokenizer_dir(tiny_model, tmp_path / "t", post_processor=post_processor,
                          chat_template=BOS_TEMPLATE, add_bos_token=add_bos)
    tok = Tokenizer(path)
    hf = _hf(path, add_bos_token=True) if add_bos else _hf(path)
    for prompt in ["hello world", "<|im_start|>x", " "]:
        assert tok.encode(prompt) == hf(prompt)["input_ids"], prompt
        assert tok.request_ids(prompt)[1] == hf(prompt)["input_ids"]
        assert tok.encode(prompt, add_special_tokens=False) == \
            hf(prompt, add_special_tokens=False)["input_ids"]
    has_bos = bool(add_bos) or post_processor is not None
    assert (tok.encode("hello")[:1] == [0]) == has_bos and tok.encode("hello")[1:2] != [0]
    # a chat prompt: the template writes the one BOS, as apply_chat_template encodes it
    ids = tok.request_ids(messages=CHAT)[1]
    assert ids == _hf_chat_ids(hf) and ids[0] == 0 and ids[1] != 0
