"""The layers every family shares: RMSNorm, the bf16-kernel Linear, its
row-parallel form, and the gated MLP's activations.

Family differences are data, not subclasses: Gemma's (1 + w) norm is its
weight plus one, folded in at load (model/loader.py), so one RMSNorm serves
every family and the fused add+norm kernel with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.model import kernels
from deepserve.model.parallel import TensorParallel
from deepserve.model.quantize import QuantizedWeight, quantize_weight


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 like the reference, then back to the activation dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_norm(self, x: torch.Tensor | None, residual: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x None: no add. The fused op
        updates residual in place (it is the layer's own running sum)."""
        if kernels.fused(residual) and self.weight.dtype == torch.bfloat16:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        if x is not None:
            residual = residual + x
        return self(residual), residual


class Linear(nn.Linear):
    """nn.Linear that, once pack() ran, multiplies with the C++ bf16 kernel
    on a packed copy of its weight (model/kernels.py), or with the int8 one
    on its quantized copy (model/quantize.py); the torch path else."""

    packed: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    """With an int8 packed weight: its group scales, packed alike (kernels.pack_linear_w8)."""
    kernel_rows: int | None = None
    """With a packed weight: inputs of up to this many rows go to the kernel,
    larger ones to torch (None: every input; kernels.kernel_max_rows)."""

    def pack(self, free_weight: bool, always: bool = False, quantize: str = "",
             stored: QuantizedWeight | None = None) -> None:
        """Pack a bf16 weight when the kernels are there: as it is, or quantized
        (stored: the checkpoint's own quantized form, quantize = "gguf";
        quantize "int8" / "int4": quantized here, model/quantize.py).
        free_weight drops the unpacked copy (not for a weight tied to the
        embedding) where the kernel serves every size; where torch wins past a
        few rows, both copies are kept (a quantized weight's torch copy becomes
        its dequantized form: both paths compute the same model). always:
        the kernel at every size (the lm_head, whose fp32 logits the kernel
        gives without a bf16 rounding)."""
        if quantize and not kernels.available():
            raise RuntimeError(f"quantize = {quantize!r} needs the C++ kernels (AVX2 + FMA, "
                               "built by bin/_venv.sh); they are not loaded here")
        if self.weight.dtype != torch.bfloat16 or not kernels.available():
            return
        self.kernel_rows = None if always else kernels.kernel_max_rows()
        quantized = stored or quantize_weight(self.weight, quantize)
        if quantized is None:
            self.packed = kernels.pack_linear_weight(self.weight.detach())
        elif quantized.mins is not None:
            self.packed, self.scales = kernels.pack_linear_w4(quantized.q, quantized.scales,
                                                              quantized.mins)
        else:
            self.packed, self.scales = kernels.pack_linear_w8(quantized.q, quantized.scales)
        if quantized is not None and stored is None and self.kernel_rows is not None:
            # torch serves larger inputs: its weight becomes the quantized one's value, so
            # both paths compute the same model (a stored form's weight is that already:
            # the loader copied its values)
            self.weight = nn.Parameter(quantized.dequantized().to(torch.bfloat16),
                                       requires_grad=False)
        if free_weight and self.kernel_rows is None:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None and (self.kernel_rows is None or
                                        x.numel() <= self.kernel_rows * x.shape[-1]):
            if self.scales is not None:
                return kernels.linear_w8(x, self.packed, self.scales, bias, self.out_features)
            return kernels.linear_bf16(x, self.packed, bias, self.out_features)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split across ranks.

    Each rank holds weight columns for its slice of the input, so its product
    is a partial sum of the full output: one all-reduce completes it. The bias
    (replicated) is added after the sum so that it counts once, not N times.
    At tp=1 this is exactly nn.Linear.
    """

    def __init__(self, local_in: int, out: int, bias: bool, tp: TensorParallel):
        super().__init__(local_in, out, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return super().forward(x)
        y = self.tp.all_reduce(self.matmul(x, None))  # (T, out), summed over ranks
        return y if self.bias is None else y + self.bias


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gated_activation(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """(T, 2I) -> (T, I): act(gate) * up, the fused kernel for bf16 silu."""
    if act == "silu" and kernels.fused(gate_up):
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
    return ACTIVATIONS[act](gate) * up
