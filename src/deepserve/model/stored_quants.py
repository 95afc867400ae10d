"""A checkpoint's own quantized weights, loaded as they are: a GGUF import's
(`quantize = "gguf"`), which keeps each Q8_0 / Q4_0 / Q4_1 / Q4_K
projection's integers and scales in QUANTS_FILE beside its bf16 safetensors
(model/gguf/blocks.py writes it; the layout is described there), and an
AWQ / GPTQ / compressed-tensors checkpoint's, read into the same layout
(model/checkpoint_quants.py).

Each projection of the model is assembled as the bf16 loader assembles it
(model/weight_map.py): q/k/v and gate/up fused by rows, each rank's shard
of rows or columns (a column shard must hold whole groups). A projection
gets a stored form only when every piece of it has one of the same kind
(int8 or int4); the others keep their bf16 weights. The file is the
importer's: a tensor of the wrong shape in it is a ModelLoadError.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepserve.errors import ModelLoadError
from deepserve.model.parallel import TensorParallel
from deepserve.model.quantize import QuantizedWeight
from deepserve.model.weight_map import Targets, _Target

QUANTS_FILE = "gguf_quants.st"
"""Not *.safetensors: loaders that take every *.safetensors of a directory
(ours, vLLM's) would read it as weights."""
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")


def stored_quants(model_dir: Path, targets: Targets, tp: TensorParallel,
                  shapes: dict[str, tuple[int, int]]) -> dict[str, QuantizedWeight]:
    """Projection weight name (of shapes: name -> this rank's (out, in)) -> its
    stored quantized form in a GGUF import; ModelLoadError where there is none."""
    path = Path(model_dir) / QUANTS_FILE
    if not path.is_file():
        raise ModelLoadError(f"quantize = \"gguf\" needs a model imported from a GGUF file "
                             f"with Q8_0 / Q4_0 / Q4_1 / Q4_K weights; {model_dir} has no "
                             f"{QUANTS_FILE}")
    try:
        with safe_open(path, framework="pt") as f:
            return assemble(f, targets, tp, shapes)
    except SafetensorError as e:
        raise ModelLoadError(f"{path} is corrupt or truncated: {e}") from e


def assemble(source, targets: Targets, tp: TensorParallel,
             shapes: dict[str, tuple[int, int]]) -> dict[str, QuantizedWeight]:
    """Every projection whose pieces `source` (safe_open's keys / get_slice:
    `X.weight.q`, `.scales`, `.mins`) holds, stacked into this rank's shard."""
    keys = set(source.keys())
    names = {key.rsplit(".", 1)[0] for key in keys}
    out = {}
    for param, parts in _pieces(targets, shapes).items():
        if all(name in names for name, _ in parts):
            weight = _assemble(source, keys, parts, tp, shapes[param], param)
            if weight is not None:
                out[param] = weight
    return out


def _pieces(targets: Targets, shapes: dict[str, tuple[int, int]]
            ) -> dict[str, list[tuple[str, _Target]]]:
    """Projection weight -> the (checkpoint name, piece) that fill it."""
    out: dict[str, list[tuple[str, _Target]]] = {}
    for name, parts in targets.items():
        for target in parts:
            if target.param in shapes and target.expert is None:
                out.setdefault(target.param, []).append((name, target))
    head, embed = TIED_HEAD
    if head in shapes and head not in out and embed in targets:  # tied: the embedding's
        out[head] = [(embed, _Target(head, targets[embed][0].shape))]
    return out


def _assemble(f, keys: set[str], parts: list[tuple[str, _Target]], tp: TensorParallel,
              shape: tuple[int, int], param: str) -> QuantizedWeight | None:
    """The pieces stacked by rows into the rank's (out, in) weight; None when a
    piece cannot be sharded by whole groups or the pieces differ in kind or
    group size."""
    read = [(target.row, _read_piece(f, keys, name, target, tp)) for name, target in parts]
    if any(w is None for _, w in read) or \
            len({(w.mins is None, w.scales.shape[1]) for _, w in read}) != 1:
        return None
    read.sort(key=lambda rw: rw[0])
    rows = [w for _, w in read]
    weight = QuantizedWeight(torch.cat([w.q for w in rows]), torch.cat([w.scales for w in rows]),
                             None if rows[0].mins is None else torch.cat([w.mins for w in rows]))
    if tuple(weight.q.shape) != shape:
        raise ModelLoadError(f"stored quantized weight {param} assembles to {tuple(weight.q.shape)}, "
                             f"the model's shard is {shape}")
    return weight


def _read_piece(f, keys: set[str], name: str, target: _Target, tp: TensorParallel
                ) -> QuantizedWeight | None:
    """This rank's shard of one stored tensor, nibbles unpacked."""
    full_rows, k = target.shape
    int4 = f"{name}.mins" in keys
    stored = {key: f.get_slice(f"{name}.{key}") for key in ("q", "scales", "mins")
              if key != "mins" or int4}
    groups = stored["scales"].get_shape()[-1]
    want = {"q": (full_rows, k // 2 if int4 else k), "scales": (full_rows, groups),
            "mins": (full_rows, groups)}
    if k % groups:
        raise ModelLoadError(f"stored quantized weight {name}.scales has {groups} groups, "
                             f"which do not divide its {k} inputs")
    for key, tensor in stored.items():
        if tuple(tensor.get_shape()) != want[key]:
            raise ModelLoadError(f"stored quantized weight {name}.{key} has shape "
                                 f"{tuple(tensor.get_shape())}, expected {want[key]}")
    group = k // groups
    start, rows = target.section or (0, full_rows)
    cols = (0, k)
    if target.dim == 0:
        rows //= tp.size
        start += tp.rank * rows
    elif target.dim == 1:
        if (k // tp.size) % group:
            return None
        cols = (tp.rank * k // tp.size, (tp.rank + 1) * k // tp.size)
    r, g = slice(start, start + rows), slice(cols[0] // group, cols[1] // group)
    scales = stored["scales"][r, g]
    if int4:
        packed = stored["q"][r, cols[0] // 2:cols[1] // 2]
        values = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, -1)
        return QuantizedWeight(values.to(torch.int8), scales, stored["mins"][r, g])
    return QuantizedWeight(stored["q"][r, cols[0]:cols[1]], scales)
