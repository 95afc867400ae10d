"""A GGUF file's metadata as the Hugging Face `config.json` and
`generation_config.json` our loader reads.

llama.cpp keeps the hyperparameters under `<arch>.*` keys (block_count,
embedding_length, attention.head_count ...); each becomes the field a
transformers checkpoint of that architecture would have. Only the
architectures in ARCHITECTURES are read: anything else is refused here, by
name, before a tensor is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepserve.errors import ModelLoadError, UnsupportedModelError

_MISSING = object()


@dataclass(frozen=True)
class Arch:
    """How one `general.architecture` maps onto a transformers model."""

    model_type: str
    hf_class: str
    permuted_qk: bool
    """llama.cpp's converter reorders the rows of Q and K of this architecture
    for its interleaved rope; HF's half-split rope needs them back."""
    qkv_bias: bool = False


ARCHITECTURES = {
    "llama": Arch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", permuted_qk=False, qkv_bias=True),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}


class Metadata:
    """The key/value part of a GGUF file (a gguf.GGUFReader's fields), with
    errors that name the file and the key."""

    def __init__(self, reader, source: str):
        self.fields, self.source = reader.fields, source

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ModelLoadError(f"{self.source}: GGUF metadata lacks {key!r}")
        return value

    def arch(self) -> tuple[str, Arch]:
        name = self.require("general.architecture")
        if name not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.source}: GGUF architecture {name!r} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}")
        return name, ARCHITECTURES[name]


def hf_config(meta: Metadata, vocab_size: int, has_output: bool) -> dict:
    """config.json of the file's model. vocab_size: rows of token_embd;
    has_output: the file has its own output.weight (else the embedding is tied)."""
    name, arch = meta.arch()
    hidden = int(meta.require(f"{name}.embedding_length"))
    heads = int(meta.require(f"{name}.attention.head_count"))
    kv_heads = _one_value(meta, f"{name}.attention.head_count_kv", heads)
    head_dim = int(meta.get(f"{name}.attention.key_length", hidden // heads))
    rotary = int(meta.get(f"{name}.rope.dimension_count", head_dim))
    if rotary != head_dim:  # partial rotary: no architecture we read has it
        raise UnsupportedModelError(f"{meta.source}: rope over {rotary} of {head_dim} "
                                    "head dimensions (partial rotary) is not supported")
    config = {
        "architectures": [arch.hf_class], "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": _one_value(meta, f"{name}.feed_forward_length"),
        "num_hidden_layers": int(meta.require(f"{name}.block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": int(meta.get(f"{name}.context_length", 2048)),
        "rms_norm_eps": float(meta.require(f"{name}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{name}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output, "hidden_act": "silu", "dtype": "bfloat16",
        **special_ids(meta),
    }
    if arch.model_type in ("llama", "qwen3"):
        config.update(attention_bias=False, mlp_bias=False)
    scaling = _rope_scaling(meta, name)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def special_ids(meta: Metadata) -> dict:
    """bos / eos / pad ids for config.json and generation_config.json; eos is
    a list when the file names a separate end-of-turn token (eot / eom)."""
    ids = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        ids["bos_token_id"] = int(bos)
    eos = [int(i) for i in (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
           if i is not None]
    eos = list(dict.fromkeys(eos))  # in order, once each
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        ids["pad_token_id"] = int(pad)
    return ids


def _one_value(meta: Metadata, key: str, default: Any = _MISSING) -> int:
    """An integer some files store per layer (an array): one value, or refused."""
    value = meta.get(key, default)
    if value is _MISSING:
        raise ModelLoadError(f"{meta.source}: GGUF metadata lacks {key!r}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{meta.source}: {key} differs between layers "
                                        f"({sorted(set(value))}); not supported")
        value = value[0]
    return int(value)


def _rope_scaling(meta: Metadata, name: str) -> dict | None:
    kind = meta.get(f"{name}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": float(meta.require(f"{name}.rope.scaling.factor"))}
    original = meta.get(f"{name}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
