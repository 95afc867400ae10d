"""Load a Hugging Face checkpoint directory into a CausalLM.

Reads `*.safetensors` memory-mapped (one file, or shards named by
`model.safetensors.index.json`), checks that every tensor the model needs is
there with the right shape, and fuses q/k/v and gate/up as it copies.
Anything wrong with the directory is a ModelLoadError naming what and where.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepserve.errors import ModelLoadError
from deepserve.model.config import ModelConfig, load_model_config
from deepserve.model.llama import CausalLM

INDEX_FILE = "model.safetensors.index.json"


def load_model(model_dir: str | Path, dtype: str | None = None) -> CausalLM:
    cfg = load_model_config(model_dir, dtype)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device="cpu")
    model.to(cfg.dtype)
    if cfg.tie_word_embeddings:  # to_empty() made two tensors of the tied one
        model.lm_head.weight = model.embed_tokens.weight
    model.layers[0].self_attn.rotary.rebuild()  # one table, shared by every layer
    _copy_weights(model, cfg, Path(model_dir))
    return model.eval()


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in load order."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(model_dir)!r} has no *.safetensors weights")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"checkpoint shards missing: {missing}")
    return files


def _targets(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """checkpoint tensor name -> (our parameter name, first row it fills)."""
    out = {"model.embed_tokens.weight": ("embed_tokens.weight", 0),
           "model.norm.weight": ("norm.weight", 0)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", 0)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{src}{norm}.weight"] = (f"{dst}{norm}.weight", 0)
        suffixes = ["weight"] + (["bias"] if cfg.qkv_bias else [])
        for proj, row in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
            for s in suffixes:
                out[f"{src}self_attn.{proj}.{s}"] = (f"{dst}self_attn.qkv_proj.{s}", row)
        for s in ["weight"] + (["bias"] if cfg.o_bias else []):
            out[f"{src}self_attn.o_proj.{s}"] = (f"{dst}self_attn.o_proj.{s}", 0)
        out[f"{src}mlp.gate_proj.weight"] = (f"{dst}mlp.gate_up_proj.weight", 0)
        out[f"{src}mlp.up_proj.weight"] = (f"{dst}mlp.gate_up_proj.weight", inter)
        out[f"{src}mlp.down_proj.weight"] = (f"{dst}mlp.down_proj.weight", 0)
    return out


def _copy_weights(model: CausalLM, cfg: ModelConfig, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    targets = _targets(cfg)
    seen: set[str] = set()
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in targets:
                        _copy_one(params, targets[name], f.get_tensor(name), name, path)
                        seen.add(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is corrupt or truncated: {e}") from e
    missing = sorted(set(targets) - seen)
    if missing:
        raise ModelLoadError(
            f"checkpoint in {str(model_dir)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _copy_one(params: dict, target: tuple[str, int], tensor: torch.Tensor,
              name: str, path: Path) -> None:
    param_name, row = target
    dst = params[param_name].data
    rows = tensor.shape[0]
    if tensor.shape[1:] != dst.shape[1:] or row + rows > dst.shape[0]:
        raise ModelLoadError(
            f"{path}: tensor {name} has shape {tuple(tensor.shape)}, which does not fit "
            f"{param_name} {tuple(dst.shape)} at row {row}")
    if param_name in ("embed_tokens.weight", "lm_head.weight") and rows != dst.shape[0]:
        raise ModelLoadError(f"{path}: {name} has {rows} rows, config says {dst.shape[0]}")
    dst[row:row + rows].copy_(tensor)
