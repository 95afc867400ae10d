"""The Llama / Qwen2 decoder over a flat batch of tokens and a paged KV pool.

Shapes: T = tokens in this step (all sequences, flattened), H/Hkv = query/KV
heads, D = head_dim, E = hidden size. q/k/v and gate/up projections are fused
at load time (one matmul each), which is what the checkpoints' separate
tensors compute.

Tensor parallelism (model/parallel.py): with tp = N each rank builds the same
modules at local sizes, Hl = H / N query heads, Hkvl = Hkv / N KV heads and
I / N MLP columns; the loader fills them with this rank's shard. o_proj and
down_proj are RowParallelLinear: one all-reduce each, bias added once after.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.model import kernels
from deepserve.model.attention import AttentionMetadata, paged_attention
from deepserve.model.config import ModelConfig
from deepserve.model.parallel import TensorParallel
from deepserve.model.rope import RotaryEmbedding


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
    on a packed copy of its weight (model/kernels.py); the torch path else."""

    packed: torch.Tensor | None = None
    kernel_rows: int | None = None
    """With a packed weight: inputs of up to this many rows go to the kernel,
    larger ones to torch (None: every input; kernels.kernel_max_rows)."""

    def pack(self, free_weight: bool, always: bool = False) -> None:
        """Pack a bf16 weight when the kernels are there. free_weight drops
        the unpacked copy (not for a weight tied to the embedding) where the
        kernel serves every size; where torch wins past a few rows, both
        copies are kept. always: the kernel at every size (the lm_head, whose
        fp32 logits the kernel gives without a bf16 rounding)."""
        if self.weight.dtype != torch.bfloat16 or not kernels.available():
            return
        self.packed = kernels.pack_linear_weight(self.weight.detach())
        self.kernel_rows = None if always else kernels.kernel_max_rows()
        if free_weight and self.kernel_rows is None:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None and (self.kernel_rows is None or
                                        x.numel() <= self.kernel_rows * x.shape[-1]):
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


_KV_HINT = " (replicating KV heads when tp > num_kv_heads is not supported yet)"


class Attention(nn.Module):
    """Self-attention over this rank's heads: Hl query heads, Hkvl KV heads.

    Heads are split in order, rank r taking query heads [r*Hl, (r+1)*Hl) and
    KV heads [r*Hkvl, (r+1)*Hkvl), so each query head keeps its GQA KV head.
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_kv_heads", _KV_HINT)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim  # local
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = kernels.fused(qkv)
        if fused:  # rotated in place, q and k together
            kernels.rotary(qkv, positions, self.rotary.cos, self.rotary.sin, self.num_heads,
                           self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, Hl, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkvl, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not fused:
            q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # (T, Hl, D)
        return self.o_proj(out.view(num_tokens, self.q_size))  # (T, E), all-reduced


class MLP(nn.Module):
    """SwiGLU over this rank's I / N intermediate columns; down_proj all-reduces."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.intermediate_size = tp.shard(cfg.intermediate_size, "intermediate_size")  # local
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 I/N)
        if kernels.fused(gate_up):
            return self.down_proj(kernels.silu_and_mul(gate_up))  # (T, E), all-reduced
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # (T, I/N) each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, positions, meta, kv):
        """x: the previous layer's MLP output (None for the first layer);
        residual: the running sum. Returns this layer's (MLP output, residual):
        the next layer adds them, as the reference's x + mlp(...) does."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, positions, meta, kv)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """forward() -> hidden states (T, E); compute_logits() -> (N, V) float32.

    With tp > 1 every rank of the group must call forward() with the same
    batch (SPMD): the layers' all-reduces pair up across ranks. Hidden states
    and logits come out whole and identical on every rank.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        # given a weight, Embedding skips its normal_() init: on the meta device
        # that init runs a torch._refs function, which imports torch._dynamo
        # (~1.2 s per process on 2 cores) for values the loader overwrites
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank stores: what its KV pool is sized by."""
        return self.config.num_kv_heads // self.tp.size  # divisibility checked in Attention

    def pack_weights(self) -> None:
        """Pack every bf16 projection for the C++ kernel (a no-op without it)."""
        for module in self.modules():
            if isinstance(module, Linear):
                is_head = module is self.lm_head
                module.pack(free_weight=not (is_head and self.config.tie_word_embeddings),
                            always=is_head)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                after_layer: Callable[[int], None] | None = None,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """after_layer(i), if given, runs once layer i's KV is in the pool
        (layer-wise KV transfer starts there while layer i+1 computes);
        before_layer(i) before layer i reads it (layer-wise KV loads)."""
        x, residual = None, self.embed_tokens(input_ids)  # (T, E)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if before_layer is not None:
                before_layer(i)
            x, residual = layer(x, residual, positions, meta, kv)
            if after_layer is not None:
                after_layer(i)
        return self.norm.add_norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head.packed is not None:
            # fp32 in, fp32 out: the kernel's accumulators, not rounded to bf16
            # first (bf16 logits tie often: 8 bits of mantissa).
            return self.lm_head(hidden.float())  # (N, V)
        return self.lm_head(hidden).float()  # (N, V)
