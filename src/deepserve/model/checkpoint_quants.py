"""Quantized Hugging Face checkpoints (config.json `quantization_config`),
read into the forms our int8 kernel runs, scales never skipped:

    method                               tensors of projection X                 kept as
    awq (bits 4, version gemm,           X.qweight (K, N / 8) int32, 8 columns   int4: q, scale s,
      zero_point)                        an int in AWQ's order; X.qzeros          min -z * s
                                         (K / G, N / 8) alike; X.scales (K / G, N)
    gptq (bits 4; desc_act off or a      X.qweight (K / 8, N), 8 rows an int;     int4: q, scale s,
      g_idx that is k // G)              X.qzeros (K / G, N / 8); X.scales;       min -z * s
                                         format "gptq" stores z - 1
    compressed-tensors (int-quantized,   X.weight (N, K) int8, X.weight_scale     int8: q, scale s
      8-bit symmetric weights by         (N, 1) channel, (1,) tensor or           (G = K, or the
      channel, tensor or group)          (N, K / G) group                         group)

The canonical form (`QuantTensors`) is the one a GGUF import stores
(model/gguf/blocks.py): per HF name `X.weight`, `.q` (int8, or int4
nibble-packed), `.scales` and for int4 `.mins`, so model/stored_quants.py
assembles both alike. A method, bit width or option outside the table is a
ModelLoadError naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepserve.errors import ModelLoadError
from deepserve.model.quant_config import QuantMethod

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""AWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7: column j is nibble this[j]."""
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class TensorSlice:
    """A tensor in memory behind the slice protocol of safetensors' get_slice."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


class QuantTensors:
    """The canonical quantized tensors of a checkpoint, behind the part of
    safe_open's interface model/stored_quants.py reads (keys, get_slice)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, key: str) -> TensorSlice:
        return TensorSlice(self.tensors[key])

    def weights(self) -> set[str]:
        """The HF weight names held (`X.weight`)."""
        return {key.rsplit(".", 1)[0] for key in self.tensors}

    def dequantized(self, name: str) -> TensorSlice:
        """The (N, K) fp32 weight `name` stands for."""
        from deepserve.model.quantize import QuantizedWeight

        q, scales = self.tensors[f"{name}.q"], self.tensors[f"{name}.scales"]
        mins = self.tensors.get(f"{name}.mins")
        if mins is not None:
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1).to(torch.int8)
        return TensorSlice(QuantizedWeight(q, scales, mins).dequantized())


def read_checkpoint_quants(files: list[Path], method: QuantMethod) -> QuantTensors:
    """Every quantized projection of the checkpoint's files, canonical."""
    out: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
                for key in sorted(keys):
                    prefix = _quantized_prefix(key, method)
                    if prefix is not None:
                        out.update(_canonical(f, keys, prefix, method, path))
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is corrupt or truncated: {e}") from e
    return QuantTensors(out)


def _quantized_prefix(key: str, method: QuantMethod) -> str | None:
    suffix = ".weight_scale" if method.name == "compressed-tensors" else ".qweight"
    return key[:-len(suffix)] if key.endswith(suffix) else None


def _canonical(f, keys: set[str], x: str, method: QuantMethod, path: Path
               ) -> dict[str, torch.Tensor]:
    def get(suffix: str) -> torch.Tensor:
        if f"{x}.{suffix}" not in keys:
            raise ModelLoadError(f"{path}: {x} has no {suffix} tensor ({method.name})")
        return f.get_tensor(f"{x}.{suffix}")

    try:
        if method.name == "compressed-tensors":
            return _int8(x, get("weight"), get("weight_scale"))
        q, zeros = (_awq_unpack(get("qweight"), get("qzeros")) if method.name == "awq"
                    else _gptq_unpack(get("qweight"), get("qzeros"),
                                      f.get_tensor(f"{x}.g_idx") if f"{x}.g_idx" in keys
                                      else None, get("scales").shape[0]))
        return _int4(x, q, zeros + method.zero_offset, get("scales"))
    except (RuntimeError, ValueError) as e:  # shapes that do not fit each other
        raise ModelLoadError(f"{path}: {x} is not a valid {method.name} tensor set: {e}") from e


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 (..., M) -> (..., M, 8): nibble i of each int at [..., i]."""
    return (packed.to(torch.int32)[..., None] >> SHIFTS) & 0x0F


def _awq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor):
    """-> q (K, N) and zeros (K / G, N), columns in their natural order."""
    order = list(AWQ_REVERSE_ORDER)
    q = _nibbles(qweight)[..., order].reshape(qweight.shape[0], -1)
    zeros = _nibbles(qzeros)[..., order].reshape(qzeros.shape[0], -1)
    return q, zeros


def _gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None,
                 groups: int):
    """-> q (K, N) and zeros (K / G, N); act-order (a g_idx that is not k // G) refused."""
    q = _nibbles(qweight.t()).reshape(qweight.shape[1], -1).t()  # row 8r + i: nibble i of row r
    k = q.shape[0]
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(k) // (k // groups)):
        raise ValueError("act-order (desc_act) GPTQ, whose g_idx reorders groups, is not "
                         "supported")
    return q, _nibbles(qzeros).reshape(qzeros.shape[0], -1)


def _int4(x: str, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
          ) -> dict[str, torch.Tensor]:
    """(K, N) q, (K / G, N) zeros and scales -> canonical (N, ...) tensors."""
    scales = scales.float()
    if q.shape[1] != scales.shape[1] or zeros.shape != scales.shape or \
            q.shape[0] % scales.shape[0]:
        raise ValueError(f"qweight {tuple(q.shape)}, qzeros {tuple(zeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit")
    q = q.t().to(torch.uint8)
    return {f"{x}.weight.q": (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(),
            f"{x}.weight.scales": scales.t().contiguous(),
            f"{x}.weight.mins": (-(zeros.float() * scales)).t().contiguous()}


def _int8(x: str, weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    if weight.dtype != torch.int8:
        raise ValueError(f"weight is {weight.dtype}, not int8")
    n, k = weight.shape
    scale = scale.float().reshape(n if scale.numel() > 1 else 1, -1).expand(n, -1)
    if k % scale.shape[1]:
        raise ValueError(f"scales {tuple(scale.shape)} do not group {k} inputs")
    return {f"{x}.weight.q": weight.contiguous(), f"{x}.weight.scales": scale.contiguous()}
