"""GGUF files written in the test by the `gguf` package (gguf.GGUFWriter),
from the tiny Hugging Face models of conftest.py: what llama.cpp's converter
would write (its tensor names, llama's Q/K rows interleaved for its rope,
the tokenizer as tokenizer.ggml.* metadata), each tensor in a chosen type.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
MIXED = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.F16,
         "attn_output": Q.BF16, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}
"""Tensor (GGUF base name) -> type; the rest (norms, biases) F32."""


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{LAYER[rest]}.{kind}"


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for llama's Q/K: per head, the rows of the two rope
    halves alternate. (heads * head_dim, ...) -> same shape."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The bytes (or array) GGUFWriter stores for w as qtype."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    return quantize(w.astype(np.float32), qtype)


def expected(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What the importer must store for w (fp32, HF order): w through qtype.
    Blocks run along rows, so interleaving rows first changes nothing."""
    return dequantize(encode(w, qtype), qtype).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, types: dict[str, Q] | None = None,
               arch: str | None = None, pre: str = "gpt-2",
               add_bos: bool = False) -> dict[str, np.ndarray]:
    """Write model_dir as a GGUF file; returns {HF name: expected fp32 weight}."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = arch or config["model_type"]
    types = MIXED if types is None else types
    writer = GGUFWriter(str(out), arch)
    _add_hparams(writer, config)
    _add_tokenizer(writer, model_dir, pre, add_bos)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    want = {}
    for name, w in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        target = gguf_name(name)
        base = target.split(".")[-2]
        qtype = types.get(base, Q.F32) if w.ndim == 2 else Q.F32
        stored = interleave(w, heads[base]) if arch == "llama" and base in heads else w
        data = encode(stored, qtype)
        writer.add_tensor(target, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        want[name] = expected(w, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return want


def _add_hparams(writer: GGUFWriter, c: dict) -> None:
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    if c.get("head_dim"):
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    # Plain rope at the file's base: llama.cpp keeps llama3 scaling as a rope_freqs
    # tensor, which the importer refuses (the tiny llama's scaling is dropped here).
    writer.add_rope_freq_base((c.get("rope_parameters") or c)["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])


def _add_tokenizer(writer: GGUFWriter, model_dir: Path, pre: str, add_bos: bool) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_bos_token_id(gen["bos_token_id"])
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_add_bos_token(add_bos)
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        writer.add_chat_template(template)
