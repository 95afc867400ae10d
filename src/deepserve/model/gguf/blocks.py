"""GGUF quantized tensors kept as they are: each block's integers and scales
read out of the file (no rounding anywhere) into the two forms our int8
kernel runs (model/stored_quants.py loads them, `quantize = "gguf"`):

    GGUF type   block            value                       kept as
    Q8_0        32, d            d * q,  q in [-128, 127]    int8: q, scale d
    Q4_0        32, d            d * (q - 8), q in [0, 15]   int4: q, scale d, min -8 d
    Q4_1        32, d, m         d * q + m                   int4: q, scale d, min m
    Q4_K        256 = 8 x 32,    d * sc_j * q - dmin * m_j   int4: q, scale d * sc_j,
                d, dmin, 6-bit sc_j and m_j                        min -(dmin * m_j)

Every scale and min is a product of an fp16 and a small integer, exact in
fp32, so q * scale + min is gguf.quants.dequantize's value bit for bit.
Other types (F16, Q5_K, Q6_K, ...) have no kept form: their projections load
from the bf16 safetensors as before. The kept tensors go to one safetensors
file beside the bf16 ones (QUANTS_FILE), per HF name N: `N.q` (int8 (rows,
K), or int4 nibble-packed uint8 (rows, K / 2): value 2i low, 2i + 1 high),
`N.scales` and, for int4, `N.mins` (fp32 (rows, K / 32)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf.quants import Q4_K

from deepserve.model.gguf.tensors import hf_name
from deepserve.model.quantize import GROUP
from deepserve.model.stored_quants import QUANTS_FILE

KEPT = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K})
"""GGUF types whose blocks are kept quantized."""


def kept_form(data: np.ndarray, qtype: QType, rows: int, cols: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A (rows, bytes) tensor of a KEPT type -> (q (rows, cols) int8 or uint8 in
    [0, 15], scales (rows, cols / 32) fp32, mins or None)."""
    blocks = np.ascontiguousarray(data).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    q, scales, mins = _DECODE[qtype](blocks)
    groups = cols // GROUP
    return (q.reshape(rows, cols), scales.reshape(rows, groups).astype(np.float32),
            None if mins is None else mins.reshape(rows, groups).astype(np.float32))


def _fp16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) values: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q8_0(blocks: np.ndarray):
    return blocks[:, 2:].view(np.int8), _fp16(blocks[:, :2]), None


def _q4_0(blocks: np.ndarray):
    d = _fp16(blocks[:, :2])
    return _nibbles(blocks[:, 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray):
    return _nibbles(blocks[:, 4:]), _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])


def _q4_k(blocks: np.ndarray):
    n = blocks.shape[0]
    d, dmin = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    chunks = blocks[:, 16:].reshape(n, 4, 32)  # 64 values a chunk: 32 low nibbles, 32 high
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8 * 32)
    return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


_DECODE = {QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q4_K: _q4_k}


def kept_tensors(reader, reorder) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """(HF name, {"q", "scales"[, "mins"]}) of every 2-D tensor of a KEPT type;
    reorder(gguf name, rows array) -> the rows in HF order (llama's Q/K)."""
    for t in reader.tensors:
        if t.tensor_type not in KEPT or len(t.shape) != 2:
            continue
        cols, rows = (int(n) for n in t.shape)
        q, scales, mins = kept_form(t.data, t.tensor_type, rows, cols)
        if mins is not None:  # int4: two values a byte
            q = q[:, 0::2].astype(np.uint8) | (q[:, 1::2].astype(np.uint8) << 4)
        parts = {"q": q, "scales": scales} | ({} if mins is None else {"mins": mins})
        yield hf_name(t.name), {k: reorder(t.name, v) for k, v in parts.items()}


def write_quants(reader, reorder, out: Path) -> int:
    """Write QUANTS_FILE into out (nothing if no tensor is kept); returns its bytes."""
    import torch
    from safetensors.torch import save_file

    tensors = {f"{name}.{k}": torch.from_numpy(np.ascontiguousarray(v))
               for name, parts in kept_tensors(reader, reorder) for k, v in parts.items()}
    if not tensors:
        return 0
    save_file(tensors, str(out / QUANTS_FILE), metadata={"format": "deepserve-gguf-quants",
                                                          "group": str(GROUP)})
    return (out / QUANTS_FILE).stat().st_size
