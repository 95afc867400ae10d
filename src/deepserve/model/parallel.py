"""Tensor parallelism: which shard this process holds, and the one collective.

A TE with `tp = N` runs N SPMD worker processes; each holds 1/N of every
layer's attention heads and MLP columns (Megatron-style): q/k/v and gate/up
are split by output rows ("column parallel"), o_proj and down_proj by input
columns ("row parallel"), so each layer needs exactly two all-reduces, one
after o_proj and one after down_proj. Embeddings, norms and lm_head are
replicated, so every rank computes the same full logits and samples the same
tokens without a gather.

`TensorParallel()` (size 1) is the single-process default: all_reduce is a
no-op and no process group is needed, so tp=1 code paths are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group: rank in [0, size)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} is not in [0, tp={self.size})")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def shard(self, total: int, what: str, hint: str = "") -> int:
        """This rank's share of `total` (heads, columns); ValueError naming tp if uneven."""
        if total % self.size:
            raise ValueError(
                f"tensor parallel size tp={self.size} does not divide {what}={total}{hint}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (the partial outputs of a row-parallel layer)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str | None = None,
                         timeout_s: float = 60, device: str | torch.device = "cpu",
                         ) -> TensorParallel:
    """Join the process group of one TE's workers; return this rank's TensorParallel.

    backend: None picks by device, nccl for CUDA and gloo otherwise. timeout_s
    bounds every collective, so a dead peer becomes an error, not a hang.
    With size 1 no group is created: a lone worker needs no collectives.
    """
    tp = TensorParallel(rank, size)
    if not tp.is_parallel:
        return tp
    if backend is None:
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return tp


def destroy_tensor_parallel() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
