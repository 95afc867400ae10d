"""One GGUF file -> the files of a Hugging Face model directory, written
into a directory the caller owns (importer.py makes it atomic and cached).

Everything that can refuse the file (architecture, tensor types and names,
tokenizer) is checked before the first weight is dequantized, so a refusal
costs the metadata read only.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from deepserve.errors import ModelLoadError
from deepserve.model.gguf.hf_config import Metadata, hf_config, special_ids
from deepserve.model.gguf.blocks import write_quants
from deepserve.model.gguf.tensors import check_tensors, hf_rows, write_safetensors
from deepserve.model.gguf.vocab import build_tokenizer, check_tokenizer, tokenizer_config


def convert(path: Path, out: Path) -> dict:
    """Write config.json, generation_config.json, tokenizer.json,
    tokenizer_config.json, the bf16 weights of GGUF `path` and its kept
    quantized ones (blocks.py) into `out`;
    returns a summary (architecture, tensor types, seconds per phase)."""
    from gguf import GGUFReader  # numpy and gguf only when converting

    started = time.perf_counter()
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:  # bad magic, truncated file, unknown enum value
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from e
    meta = Metadata(reader, str(path))
    arch_name, arch = meta.arch()
    check_tensors(reader, str(path), arch_name)
    check_tokenizer(meta)
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    vocab_size = int(names["token_embd.weight"].shape[1])  # GGUF shape: (hidden, vocab)
    config = hf_config(meta, vocab_size, has_output="output.weight" in names)
    read_s = time.perf_counter() - started
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", special_ids(meta))
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta))
    weights_started = time.perf_counter()
    num_bytes = write_safetensors(reader, arch, config, out)
    kept_bytes = write_quants(reader, hf_rows(arch, config), out)
    return {"architecture": arch_name, "model_type": arch.model_type,
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
            "weight_bytes": num_bytes, "kept_quantized_bytes": kept_bytes, "read_s": round(read_s, 3),
            "weights_s": round(time.perf_counter() - weights_started, 3)}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
