"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks top_k
of E experts per token, and each expert runs once per step as one GEMM over
the tokens routed to it (grouped by expert, never a loop over tokens).

Routing, as the references compute it: softmax over the router's logits in
float32, the top_k probabilities, renormalised to sum to 1 when
`norm_topk_prob` (Mixtral always), cast back to the activation dtype.

Tensor parallelism splits every expert the way a dense MLP is split: each
rank holds all E experts' gate/up rows and down columns for its I / N slice
of the expert's intermediate size, so a rank computes a partial sum of every
expert's output and one all-reduce after the weighted sum completes the
layer (the router is replicated: every rank routes identically).

Weights (this rank's), stacked per expert:
    gate_up: (E, 2 I/N, E_hidden)   rows [0, I/N) gate, [I/N, 2 I/N) up
    down:    (E, E_hidden, I/N)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.model.config import MoEConfig
from deepserve.model.layers import gated_activation
from deepserve.model.parallel import TensorParallel


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig, act: str, tp: TensorParallel):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.intermediate_size = tp.shard(cfg.intermediate_size, "moe_intermediate_size")
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)  # the router, replicated
        self.gate_up = nn.Parameter(torch.empty(cfg.num_experts, 2 * self.intermediate_size,
                                                hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(cfg.num_experts, hidden, self.intermediate_size),
                                 requires_grad=False)
        self.act, self.tp = act, tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, E_hidden) -> (T, k) expert ids, (T, k) weights in x's dtype."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()  # (T k,) token t's j-th choice at t k + j
        order = torch.argsort(flat, stable=True)  # grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k  # (T k,) the token of each grouped row
        scale = weights.flatten()[order].unsqueeze(1)  # (T k, 1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            h = gated_activation(F.linear(x[rows], self.gate_up[expert]), self.act)
            y = F.linear(h, self.down[expert]) * scale[start:start + count]  # (n, E_hidden)
            out.index_add_(0, rows, y)
            start += count
        return self.tp.all_reduce(out)
