"""Quantizing a checkpoint's weights at load (`quantize = "int8"` or "int4" on a
TE, `--quantize int8|int4`; a GGUF file's own quantized weights take the same
forms: model/stored_quants.py). int8: round to nearest, symmetric, one fp32 scale per group of
GROUP consecutive input features of each output channel (a per-channel scale
where GROUP does not divide the row): w ~= q * s, q in [-127, 127], s =
max |w[n, group]| / 127 (llama.cpp's Q8_0 has groups of 32 too). The int8
values feed the kernel's linear_w8 (model/kernels.py), which streams
1 + 4 / GROUP bytes per weight in a decode step instead of bf16's two.

int4 (llama.cpp's Q4_1): groups of GROUP, w ~= q * s + m, q in [0, 15], m the
group's smallest value, s = (largest - smallest) / 15; 0.5 + 8 / GROUP bytes
per weight.

Only the projections are quantized (attention q/k/v/o, the MLP, the lm_head);
embeddings and norms stay in the checkpoint's dtype. A group of zeros gets
scale 1 (its q is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = 127
QMAX4 = 15
GROUP = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """A projection's weight in a form the int8 kernel runs: q (N, K) int8, in
    [-128, 127] with scales (N, K / G) fp32 and mins None (int8), or in [0, 15]
    with mins (N, K / G) fp32 too (int4)."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight it stands for."""
        if self.mins is None:
            return dequantize_int8(self.q, self.scales)
        return dequantize_int4(self.q, self.scales, self.mins)


def quantize_weight(weight: torch.Tensor, mode: str) -> QuantizedWeight | None:
    """weight quantized as `mode` says ("int4" where GROUP divides its input,
    else int8; None for any other mode: it stays as it is)."""
    if mode == "int4" and weight.shape[1] % GROUP == 0:
        return QuantizedWeight(*quantize_int4(weight))
    if mode in ("int8", "int4"):
        return QuantizedWeight(*quantize_int8(weight))
    return None


def quantize_int8(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q (N, K) int8, scales (N, K / G) fp32) with weight ~= q times
    its group's scale; G = group where it divides K, else K (one scale a row)."""
    w = weight.detach().float()
    n, k = w.shape
    g = group if k % group == 0 else k
    groups = w.view(n, k // g, g)
    scales = groups.abs().amax(dim=2) / QMAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / scales[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(n, k), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int8 one stands for (the reference the kernel is tested on)."""
    g = q.shape[1] // scales.shape[1]
    return q.float() * scales.repeat_interleave(g, dim=1)


def quantize_int4(weight: torch.Tensor, group: int = GROUP
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q (N, K) int8 in [0, 15], scales and mins (N, K / group)
    fp32) with weight ~= q * scale + min of its group; K must be a multiple of
    group (ValueError)."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs input features in groups of {group}; this weight has {k}")
    groups = w.view(n, k // group, group)
    mins, maxs = groups.amin(dim=2), groups.amax(dim=2)
    scales = (maxs - mins) / QMAX4
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((groups - mins[:, :, None]) / scales[:, :, None]).clamp_(0, QMAX4)
    return q.to(torch.int8).view(n, k), scales.contiguous(), mins.contiguous()


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int4 one stands for."""
    g = q.shape[1] // scales.shape[1]
    return q.float() * scales.repeat_interleave(g, dim=1) + mins.repeat_interleave(g, dim=1)
