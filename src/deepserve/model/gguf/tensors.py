"""A GGUF file's tensors as Hugging Face bf16 safetensors.

Every tensor is dequantized at import with `gguf.quants.dequantize` (to
fp32), renamed to the transformers name, and for llama's Q and K put back in
the row order transformers' half-split rope expects, then rounded to bf16.
Beside them, blocks.py keeps the Q8_0 / Q4_* tensors' own integers and
scales for the int8 kernel (`quantize = "gguf"`): the bf16 files stay an
ordinary checkpoint every loader reads. A tensor of a type outside DEQUANTIZED, or a
name we do not map, is refused before anything is written.

    GGUF (ne0 = in, ne1 = out)   token_embd.weight   blk.3.attn_q.weight (Q4_1)
    numpy / torch (out, in)      model.embed_tokens  model.layers.3.self_attn.q_proj
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from deepserve.errors import UnsupportedModelError
from deepserve.model.gguf.hf_config import Arch

DEQUANTIZED = frozenset({QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0,
                         QType.Q4_1, QType.Q4_K, QType.Q5_K, QType.Q6_K})
"""Tensor types read (dequantized at import); any other is refused by name."""
MAX_SHARD_BYTES = 2 << 30
"""bf16 bytes per safetensors file: what the importer holds in memory at once."""

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """The transformers name of a GGUF tensor name; None if we do not map it."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    layer, base, kind = m.groups()
    if layer is None:
        return f"{_GLOBAL[base]}.{kind}" if base in _GLOBAL else None
    return f"model.layers.{layer}.{_LAYER[base]}.{kind}" if base in _LAYER else None


def check_tensors(reader, source: str, arch_name: str) -> None:
    """Refuse, naming it, the first tensor whose type or name we do not read."""
    for t in reader.tensors:
        if t.tensor_type not in DEQUANTIZED:
            raise UnsupportedModelError(
                f"{source}: tensor {t.name} has GGUF type {t.tensor_type.name}, which is not "
                f"supported; supported: {sorted(q.name for q in DEQUANTIZED)}")
        if hf_name(t.name) is None:
            raise UnsupportedModelError(
                f"{source}: tensor {t.name} of GGUF architecture {arch_name!r} is not read "
                "by the importer")


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Within each head it stores the rows of
    the two rope halves interleaved (row 2i = half 0, row 2i+1 = half 1, so
    its rope rotates adjacent pairs); HF's rotate_half wants half 0's rows
    first, then half 1's. w: (heads * head_dim, ...) weight or bias."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    w = w.reshape(num_heads, head_dim // 2, 2, *rest)  # (H, D/2, half, ...)
    return w.swapaxes(1, 2).reshape(num_heads * head_dim, *rest)  # (H, half, D/2, ...)


def hf_rows(arch: Arch, config: dict) -> Callable[[str, np.ndarray], np.ndarray]:
    """(GGUF tensor name, array by its rows) -> the rows in HF order: llama's Q/K
    rows unpermuted, every other tensor as it is."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def reorder(name: str, rows: np.ndarray) -> np.ndarray:
        base = _NAME.fullmatch(name).group(2)
        return unpermute(rows, heads[base]) if arch.permuted_qk and base in heads else rows
    return reorder


def hf_tensors(reader, arch: Arch, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers name, fp32 array in torch's (out, in) order) per tensor."""
    reorder = hf_rows(arch, config)
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
        yield hf_name(t.name), reorder(t.name, w)


def write_safetensors(reader, arch: Arch, config: dict, out: Path) -> int:
    """Write the weights as bf16 safetensors into `out` (one file, or shards
    and model.safetensors.index.json past MAX_SHARD_BYTES); returns bytes."""
    import torch  # here: a cache hit never pays for it
    from safetensors.torch import save_file

    shards = _plan_shards([int(t.n_elements) * 2 for t in reader.tensors])
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, tensors, total = {}, hf_tensors(reader, arch, config), 0
    for file, count in zip(files, shards):
        part = {}
        for _ in range(count):
            name, w = next(tensors)
            w = np.require(w, np.float32, ["C", "W"])  # a copy if a read-only memmap view
            part[name] = torch.from_numpy(w).to(torch.bfloat16)
            weight_map[name] = file
            total += part[name].numel() * 2
        save_file(part, str(out / file), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _plan_shards(sizes: list[int]) -> list[int]:
    """Tensors per shard, in file order, each shard under MAX_SHARD_BYTES
    (a tensor larger than that gets a shard to itself)."""
    counts, used = [0], 0
    for size in sizes:
        if counts[-1] and used + size > MAX_SHARD_BYTES:
            counts.append(0)
            used = 0
        counts[-1] += 1
        used += size
    return counts
