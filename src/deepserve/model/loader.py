"""Load a Hugging Face checkpoint directory into a CausalLM.

Reads `*.safetensors` memory-mapped (one file, or shards named by
`model.safetensors.index.json`), checks that every tensor the model needs is
there with the right shape, and fuses q/k/v and gate/up as it copies.
Anything wrong with the directory is a ModelLoadError naming what and where.

With tensor parallelism each rank reads only its shard of each tensor
(`safe_open(...).get_slice`): rows of q/k/v (and their biases) by its heads,
rows of gate/up by its intermediate slice, columns of o_proj and down_proj.
Every tensor's full shape is still checked against the config first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepserve.errors import ModelLoadError
from deepserve.model.config import ModelConfig, load_model_config
from deepserve.model.llama import CausalLM
from deepserve.model.parallel import TensorParallel

INDEX_FILE = "model.safetensors.index.json"


def load_model(model_dir: str | Path, dtype: str | None = None,
               tp: TensorParallel = TensorParallel()) -> CausalLM:
    """This rank's CausalLM (the whole model at tp=1); ValueError if tp does not divide it."""
    cfg = load_model_config(model_dir, dtype)
    with torch.device("meta"):
        model = CausalLM(cfg, tp)  # raises before any weight is read
    model.to_empty(device="cpu")
    model.to(cfg.dtype)
    if cfg.tie_word_embeddings:  # to_empty() made two tensors of the tied one
        model.lm_head.weight = model.embed_tokens.weight
    model.layers[0].self_attn.rotary.rebuild()  # one table, shared by every layer
    _copy_weights(model, _targets(cfg, tp), tp, Path(model_dir))
    model.pack_weights()
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


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes.

    param: our parameter; row: its first row this tensor fills (fused q/k/v,
    gate/up); shape: the full checkpoint shape the config implies; dim: the
    dimension split across tp ranks (0: output rows, 1: input columns), None
    when every rank holds the whole tensor.
    """

    param: str
    shape: tuple[int, ...]
    row: int = 0
    dim: int | None = None


def _targets(cfg: ModelConfig, tp: TensorParallel) -> dict[str, _Target]:
    """checkpoint tensor name -> where (this rank's shard of) it goes."""
    e, v = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": _Target("embed_tokens.weight", (v, e)),
           "model.norm.weight": _Target("norm.weight", (e,))}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _Target("lm_head.weight", (v, e))
    for i in range(cfg.num_layers):
        out.update(_layer_targets(cfg, tp, f"model.layers.{i}.", f"layers.{i}."))
    return out


def _layer_targets(cfg: ModelConfig, tp: TensorParallel, src: str,
                   dst: str) -> dict[str, _Target]:
    e, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    q_local, kv_local, inter_local = q // tp.size, kv // tp.size, inter // tp.size
    out = {f"{src}{norm}.weight": _Target(f"{dst}{norm}.weight", (e,))
           for norm in ("input_layernorm", "post_attention_layernorm")}
    qkv = f"{dst}self_attn.qkv_proj."
    for proj, rows, row in (("q_proj", q, 0), ("k_proj", kv, q_local),
                            ("v_proj", kv, q_local + kv_local)):
        out[f"{src}self_attn.{proj}.weight"] = _Target(qkv + "weight", (rows, e), row, 0)
        if cfg.qkv_bias:
            out[f"{src}self_attn.{proj}.bias"] = _Target(qkv + "bias", (rows,), row, 0)
    out[f"{src}self_attn.o_proj.weight"] = _Target(f"{dst}self_attn.o_proj.weight", (e, q), dim=1)
    if cfg.o_bias:  # replicated: RowParallelLinear adds it once, after the all-reduce
        out[f"{src}self_attn.o_proj.bias"] = _Target(f"{dst}self_attn.o_proj.bias", (e,))
    gate_up = f"{dst}mlp.gate_up_proj.weight"
    out[f"{src}mlp.gate_proj.weight"] = _Target(gate_up, (inter, e), 0, 0)
    out[f"{src}mlp.up_proj.weight"] = _Target(gate_up, (inter, e), inter_local, 0)
    out[f"{src}mlp.down_proj.weight"] = _Target(f"{dst}mlp.down_proj.weight", (e, inter), dim=1)
    return out


def _copy_weights(model: CausalLM, targets: dict[str, _Target], tp: TensorParallel,
                  model_dir: Path) -> None:
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in targets:
                        _copy_one(params, targets[name], tp, f.get_slice(name), name, path)
                        seen.add(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is corrupt or truncated: {e}") from e
    missing = sorted(set(targets) - seen)
    if missing:
        raise ModelLoadError(
            f"checkpoint in {str(model_dir)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _copy_one(params: dict, target: _Target, tp: TensorParallel, tensor_slice,
              name: str, path: Path) -> None:
    """Check the full shape, then read and copy only this rank's shard."""
    shape = tuple(tensor_slice.get_shape())
    if shape != target.shape:
        if target.param in ("embed_tokens.weight", "lm_head.weight") and \
                shape[1:] == target.shape[1:]:
            raise ModelLoadError(
                f"{path}: {name} has {shape[0]} rows, config says {target.shape[0]}")
        raise ModelLoadError(
            f"{path}: tensor {name} has shape {shape}, but the config implies "
            f"{target.shape} (for {target.param})")
    shard = _read_shard(tensor_slice, target, tp)
    dst = params[target.param].data
    dst[target.row:target.row + shard.shape[0]].copy_(shard)


def _read_shard(tensor_slice, target: _Target, tp: TensorParallel) -> torch.Tensor:
    """Read this rank's part of the tensor from the memory-mapped file, no more."""
    if target.dim is None:
        return tensor_slice[:]
    size = target.shape[target.dim] // tp.size
    part = slice(tp.rank * size, (tp.rank + 1) * size)
    return tensor_slice[part] if target.dim == 0 else tensor_slice[:, part]
