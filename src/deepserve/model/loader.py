"""Load a Hugging Face checkpoint directory into a CausalLM.

Reads `*.safetensors` memory-mapped (one file, or shards named by
`model.safetensors.index.json`), checks that every tensor the model needs is
there with the right shape, and fuses q/k/v and gate/up as it copies (where
each tensor goes: model/weight_map.py). Anything wrong with the directory is
a ModelLoadError naming what and where.

With tensor parallelism each rank reads only its shard of each tensor
(`safe_open(...).get_slice`): rows of q/k/v (and their biases) by its heads,
rows of gate/up by its intermediate slice (each expert's too), columns of
o_proj and down_proj. Every tensor's full shape is still checked against the
config first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepserve.errors import ModelLoadError
from deepserve.model.config import load_model_config
from deepserve.model.decoder import CausalLM
from deepserve.model.parallel import TensorParallel
from deepserve.model.checkpoint_quants import QuantTensors, read_checkpoint_quants
from deepserve.model.stored_quants import assemble, stored_quants
from deepserve.model.weight_map import Targets, _Target, checkpoint_targets

INDEX_FILE = "model.safetensors.index.json"


def load_model(model_dir: str | Path, dtype: str | None = None,
               tp: TensorParallel = TensorParallel(), quantize: str = "") -> CausalLM:
    """This rank's CausalLM (the whole model at tp=1); ValueError if tp does not divide
    it. quantize "int8" / "int4": its projections quantized (model/quantize.py); "gguf":
    a GGUF import's projections as the file quantized them (model/stored_quants.py); a
    quantized checkpoint (AWQ, GPTQ, compressed-tensors) runs its own weights
    (model/checkpoint_quants.py). ModelLoadError where the model is not bf16 or the
    kernels are not loaded."""
    cfg, model_dir = load_model_config(model_dir, dtype), Path(model_dir)
    if cfg.quantization and quantize:
        raise ModelLoadError(f"{model_dir} is a {cfg.quantization.name} checkpoint, quantized "
                             f"already: quantize = {quantize!r} does not apply (leave it unset)")
    with torch.device("meta"):
        model = CausalLM(cfg, tp)  # raises before any weight is read
    model.to_empty(device="cpu")
    model.to(cfg.dtype)
    if cfg.tie_word_embeddings:  # to_empty() made two tensors of the tied one
        model.lm_head.weight = model.embed_tokens.weight
    model.rebuild_rotary()  # one table per distinct rope, shared by its layers
    targets = checkpoint_targets(cfg, tp)
    quants = read_checkpoint_quants(checkpoint_files(model_dir), cfg.quantization) \
        if cfg.quantization else None
    if quants is not None and not quants.weights() & set(targets):
        raise ModelLoadError(f"{model_dir}: quantization_config says "
                             f"{cfg.quantization.name}, but no projection has its tensors")
    _copy_weights(model, targets, tp, model_dir, quants)
    if (quantize or quants) and cfg.dtype != torch.bfloat16:
        what = f"quantize = {quantize!r}" if quantize else f"a {cfg.quantization.name} checkpoint"
        raise ModelLoadError(f"{what} needs a bfloat16 model; {model_dir} "
                             f"loads as {cfg.dtype} (set dtype = \"bfloat16\")")
    stored = {}
    if quantize == "gguf":
        stored = stored_quants(model_dir, targets, tp, model.linear_shapes())
    elif quants:
        stored = assemble(quants, targets, tp, model.linear_shapes())
    try:
        model.pack_weights(quantize, stored)
    except RuntimeError as e:  # quantized weights without the kernels to run them
        raise ModelLoadError(str(e)) from None
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


def _copy_weights(model: CausalLM, targets: Targets, tp: TensorParallel,
                  model_dir: Path, quants: QuantTensors | None = None) -> None:
    """Every target's tensor into its parameter; a quantized checkpoint's
    projections (quants) as the values they stand for."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    quantized = quants.weights() if quants else set()
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    for target in targets.get(name, ()) if name not in quantized else ():
                        _copy_one(params, target, tp, f.get_slice(name), name, path)
                        seen.add(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is corrupt or truncated: {e}") from e
    for name in sorted(quantized & set(targets)):
        for target in targets[name]:
            _copy_one(params, target, tp, quants.dequantized(name), name, model_dir)
        seen.add(name)
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
    if target.expert is not None:
        dst = dst[target.expert]
    dst = dst[target.row:target.row + shard.shape[0]]
    dst.copy_(shard)
    if target.offset:
        dst.add_(target.offset)


def _read_shard(tensor_slice, target: _Target, tp: TensorParallel) -> torch.Tensor:
    """Read this rank's part of the tensor (of its section) from the
    memory-mapped file, no more."""
    start, rows = target.section or (0, target.shape[0])
    if target.dim is None:
        return tensor_slice[start:start + rows] if target.section else tensor_slice[:]
    size = target.shape[target.dim] // tp.size
    if target.dim == 1:
        return tensor_slice[:, tp.rank * size:(tp.rank + 1) * size]
    size = rows // tp.size
    return tensor_slice[start + tp.rank * size:start + (tp.rank + 1) * size]
