"""A GGUF file's tokenizer metadata (`tokenizer.ggml.*`) as `tokenizer.json`
and `tokenizer_config.json`, built with the `tokenizers` library.

A GGUF keeps the vocabulary, the merges, each token's type and the name of
the pre-tokenizer (`tokenizer.ggml.pre`) the merges were learned with; the
split rules behind that name live in llama.cpp's code, so PRE_TOKENIZERS
restates them for the names we know. A byte-level BPE (`gpt2`) vocabulary is
built; any other tokenizer model, or a pre-tokenizer name not listed, is
refused: a tokenizer that splits text differently from the one the model
was trained on gives plausible but wrong ids.

    tokenizer.ggml.tokens / merges      BPE vocab and merges (byte-level spelling)
    tokenizer.ggml.token_type           3 control -> special added token,
                                        4 user-defined -> added token
    tokenizer.ggml.pre                  the pre-tokenizer (PRE_TOKENIZERS)
    tokenizer.ggml.add_bos_token        BOS prepended by the post-processor
    tokenizer.chat_template             tokenizer_config.json chat_template
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from deepserve.errors import ModelLoadError
from deepserve.model.gguf.hf_config import Metadata

CONTROL, USER_DEFINED = 3, 4
"""llama.cpp's token types that are matched whole in text (added tokens)."""

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2(add_prefix_space: bool):
    """GPT-2's split (ByteLevel's own regex), then bytes to their BPE spelling."""
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _digits_gpt2(add_prefix_space: bool):
    """Every digit on its own, then GPT-2's split (StarCoder, SmolLM)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    _gpt2(add_prefix_space)])


def _split(pattern: str):
    def build(add_prefix_space: bool):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
    return build


PRE_TOKENIZERS = {
    "gpt-2": _gpt2, "smollm": _digits_gpt2, "starcoder": _digits_gpt2,
    "refact": _digits_gpt2, "llama-bpe": _split(_LLAMA3_SPLIT),
    "smaug-bpe": _split(_LLAMA3_SPLIT), "dbrx": _split(_LLAMA3_SPLIT),
    "qwen2": _split(_QWEN2_SPLIT), "deepseek-r1-qwen": _split(_QWEN2_SPLIT),
}
"""tokenizer.ggml.pre -> builder(add_prefix_space) of the matching pre-tokenizer."""
_IGNORE_MERGES = {"llama-bpe", "smaug-bpe", "dbrx"}
"""Vocabularies whose words found whole in the vocabulary skip the merges (Llama 3)."""


def check_tokenizer(meta: Metadata) -> None:
    """Refuse, before any work, a tokenizer this module does not build."""
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{meta.source}: GGUF tokenizer model {kind!r} is not supported; "
                             "supported: ['gpt2'] (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{meta.source}: GGUF pre-tokenizer {pre!r} is not supported; "
                             f"supported: {sorted(PRE_TOKENIZERS)}")


def build_tokenizer(meta: Metadata) -> Tokenizer:
    """tokenizer.json's Tokenizer: byte-level BPE with the file's split rules."""
    check_tokenizer(meta)
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre](bool(meta.get("tokenizer.ggml.add_space_prefix")))
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _post_processor(meta: Metadata, tokens: list[str]):
    """ByteLevel offsets, and BOS / EOS around each sequence when the file says so."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos, eos = _added(meta, tokens, "bos"), _added(meta, tokens, "eos")
    if bos is None and eos is None:
        return byte_level
    ends = [e for e in (bos, eos) if e is not None]

    def wrap(part: str, type_id: int) -> str:
        pieces = [e[0] for e in (bos,) if e] + [part] + [e[0] for e in (eos,) if e]
        return " ".join(f"{p}:{type_id}" for p in pieces)

    template = processors.TemplateProcessing(
        single=wrap("$A", 0), pair=f"{wrap('$A', 0)} {wrap('$B', 1)}",
        special_tokens=list(dict.fromkeys(ends)))
    return processors.Sequence([byte_level, template])


def _added(meta: Metadata, tokens: list[str], which: str) -> tuple[str, int] | None:
    """(text, id) of BOS / EOS when tokenizer.ggml.add_<which>_token is set."""
    token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
    if not meta.get(f"tokenizer.ggml.add_{which}_token") or token_id is None:
        return None
    return tokens[int(token_id)], int(token_id)


def tokenizer_config(meta: Metadata) -> dict:
    """tokenizer_config.json: the special tokens' texts, add_bos_token and the chat template."""
    tokens = meta.require("tokenizer.ggml.tokens")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        config[name] = tokens[int(token_id)] if token_id is not None else None
    context = meta.get(f"{meta.require('general.architecture')}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
