"""The decoder every supported family runs, over a flat batch of tokens and a
paged KV pool: Llama, Qwen2/3, Mistral, Phi-3, Gemma 3, Qwen3-MoE, Mixtral.

Shapes: T = tokens in this step (all sequences, flattened), H/Hkv = query/KV
heads, D = head_dim, E = hidden size. q/k/v and gate/up projections are fused
at load time (one matmul each), which is what the checkpoints' separate
tensors compute. What a family changes is read from ModelConfig flags
(model/architectures.py): q/k norms, sliding layers and their own rope,
Gemma's sandwich norms, embedding scale and soft caps, MoE MLPs.

Tensor parallelism (model/parallel.py): with tp = N each rank builds the same
modules at local sizes, Hl = H / N query heads, Hkvl = Hkv / N KV heads and
I / N MLP columns (each expert's too, model/moe.py); the loader fills them
with this rank's shard. o_proj and down_proj are RowParallelLinear: one
all-reduce each, bias added once after.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepserve.model import kernels
from deepserve.model.attention import AttentionKind, AttentionMetadata, paged_attention
from deepserve.model.config import ModelConfig, RopeConfig
from deepserve.model.layers import Linear, RMSNorm, RowParallelLinear, gated_activation
from deepserve.model.moe import SparseMoE
from deepserve.model.parallel import TensorParallel
from deepserve.model.quantize import QuantizedWeight
from deepserve.model.rope import RotaryEmbedding

_KV_HINT = " (replicating KV heads when tp > num_kv_heads is not supported yet)"


class Attention(nn.Module):
    """Self-attention over this rank's heads: Hl query heads, Hkvl KV heads.

    Heads are split in order, rank r taking query heads [r*Hl, (r+1)*Hl) and
    KV heads [r*Hkvl, (r+1)*Hkvl), so each query head keeps its GQA KV head.
    """

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 tp: TensorParallel):
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_kv_heads", _KV_HINT)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim  # local
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.kind = AttentionKind(
            scale=cfg.attn_scale or cfg.head_dim ** -0.5,
            window=cfg.sliding_window if cfg.is_sliding(layer) else None,
            softcap=cfg.attn_softcap)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (Hl + 2 Hkvl) D)
        if self.q_norm is not None:
            self._norm_heads(qkv, num_tokens)
        fused = kernels.fused(qkv) and not self.rotary.is_partial
        if fused:  # rotated in place, q and k together
            kernels.rotary(qkv, positions, self.rotary.cos, self.rotary.sin, self.num_heads,
                           self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, Hl, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkvl, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not fused:
            q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.kind)  # (T, Hl, D)
        return self.o_proj(out.view(num_tokens, self.q_size))  # (T, E), all-reduced

    def _norm_heads(self, qkv: torch.Tensor, num_tokens: int) -> None:
        """RMSNorm each head of q and k over D, in place in qkv (before rope)."""
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(
            num_tokens, self.num_kv_heads, self.head_dim)
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))


class MLP(nn.Module):
    """Gated MLP (SwiGLU / GeGLU) over this rank's I / N intermediate columns;
    down_proj all-reduces."""

    def __init__(self, hidden: int, intermediate: int, act: str, tp: TensorParallel):
        super().__init__()
        self.intermediate_size = tp.shard(intermediate, "intermediate_size")  # local
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, hidden, False, tp)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gated_activation(self.gate_up_proj(x), self.act)  # (T, I/N)
        return self.down_proj(h)  # (T, E), all-reduced


def _mlp(cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
    if cfg.moe is not None and cfg.moe.sparse_layers[layer]:
        return SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, tp)
    return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 tp: TensorParallel):
        super().__init__()
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(e, eps)
        self.self_attn = Attention(cfg, layer, rotary, tp)
        self.post_attention_layernorm = RMSNorm(e, eps)
        self.mlp = _mlp(cfg, layer, tp)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(e, eps)
            self.post_feedforward_layernorm = RMSNorm(e, eps)

    def forward(self, x, residual, positions, meta, kv):
        """x: the previous layer's MLP output (None for the first layer);
        residual: the running sum. Returns this layer's (MLP output, residual):
        the next layer adds them, as the reference's x + mlp(...) does."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, positions, meta, kv)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.add_norm(h, residual)
            return self.mlp(h), residual
        # Gemma 3: the attention output is normed before it joins the residual,
        # and the MLP output is normed after.
        h, residual = self.pre_feedforward_layernorm.add_norm(
            self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


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
        tables: dict[RopeConfig, RotaryEmbedding] = {}  # one table per distinct rope
        for rope in {cfg.layer_rope(i) for i in range(cfg.num_layers)}:
            tables[rope] = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, rope,
                                           cfg.rotary_dim)
        # given a weight, Embedding skips its normal_() init: on the meta device
        # that init runs a torch._refs function, which imports torch._dynamo
        # (~1.2 s per process on 2 cores) for values the loader overwrites
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tables[cfg.layer_rope(i)], tp)
                                    for i in range(cfg.num_layers))
        self.rotary_tables = list(tables.values())
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank stores: what its KV pool is sized by."""
        return self.config.num_kv_heads // self.tp.size  # divisibility checked in Attention

    def rebuild_rotary(self) -> None:
        """Compute the rope tables (after the module was built on `meta`)."""
        for table in self.rotary_tables:
            table.rebuild()

    def pack_weights(self, quantize: str = "",
                     stored: dict[str, QuantizedWeight] | None = None) -> None:
        """Pack every bf16 projection for the C++ kernel (a no-op without it;
        quantize "int8" / "int4": quantized, RuntimeError without it); stored:
        projection weight name -> its checkpoint's own quantized form."""
        stored = stored or {}
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                is_head = module is self.lm_head
                module.pack(free_weight=not (is_head and self.config.tie_word_embeddings),
                            always=is_head, quantize=quantize,
                            stored=stored.get(f"{name}.weight"))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Projection weight name -> (out, in) of this rank's shard."""
        return {f"{name}.weight": (m.out_features, m.in_features)
                for name, m in self.named_modules() if isinstance(m, Linear)}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                after_layer: Callable[[int], None] | None = None,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """after_layer(i), if given, runs once layer i's KV is in the pool
        (layer-wise KV transfer starts there while layer i+1 computes);
        before_layer(i) before layer i reads it (layer-wise KV loads)."""
        x, residual = None, self._embed(input_ids)  # (T, E)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if before_layer is not None:
                before_layer(i)
            x, residual = layer(x, residual, positions, meta, kv)
            if after_layer is not None:
                after_layer(i)
        return self.norm.add_norm(x, residual)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, E)
        if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the weights' dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head.packed is not None:
            # fp32 in, fp32 out: the kernel's accumulators, not rounded to bf16
            # first (bf16 logits tie often: 8 bits of mantissa).
            logits = self.lm_head(hidden.float())  # (N, V)
        else:
            logits = self.lm_head(hidden).float()  # (N, V)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
