"""The C++ kernels (model/csrc) when they are built, the torch path when not.

Two ops, both for CPUs with AVX2 + FMA (checked before loading):

  * linear_bf16: bf16 weights, fp32 arithmetic (see csrc/linear.cpp), on
    weights packed once at load time by pack_linear_weight;
  * paged_decode_attention: one query token per sequence over the paged KV
    pool, read in place (see csrc/decode_attention.cpp).

The library is built at install time (model/build_kernels.py); nothing here
compiles. DEEPSERVE_KERNELS=0 turns the kernels off (the torch path, for
comparisons); a missing or unloadable library does the same, with one log
line saying why.
"""

from __future__ import annotations

import logging
import os

import torch

from deepserve.model.build_kernels import library_path

log = logging.getLogger(__name__)
_PANEL = 16  # output columns per packed panel
_state: dict[str, bool] = {}


def available() -> bool:
    """True once the library is loaded; tries (and logs a failure) only once."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return _state["ok"]


def _load() -> bool:
    if os.environ.get("DEEPSERVE_KERNELS", "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("C++ kernels need AVX2 + FMA; using the torch path")
        return False
    path = library_path()
    if not path.is_file():
        log.warning("C++ kernels not built (%s); using the torch path "
                    "(bin/_venv.sh builds them: python -m deepserve.model.build_kernels)", path)
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        log.warning("C++ kernels at %s failed to load (%s); using the torch path", path, e)
        return False
    return True


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> (ceil(N / 16), K, 16): panel p, row k, lane j holds
    columns 16p + j (low half) and 16p + 8 + j (high half) for j < 8; the
    last panel is zero-padded."""
    n, k = weight.shape
    num_panels = -(-n // _PANEL)
    w = weight.to(torch.bfloat16)
    if num_panels * _PANEL != n:
        w = torch.cat([w, w.new_zeros(num_panels * _PANEL - n, k)])
    # (NP, 2 halves, 8 lanes, K) -> (NP, K, 8 lanes, 2 halves)
    return w.view(num_panels, 2, 8, k).permute(0, 3, 2, 1).contiguous().view(num_panels, k, _PANEL)


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x: (..., K) bf16 or fp32 -> (..., N) in x's dtype."""
    lead = x.shape[:-1]
    out = torch.ops.deepserve.linear_bf16(x.reshape(-1, x.shape[-1]), packed, bias, out_features)
    return out.view(*lead, out_features)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q: (B, H, D); caches: (Hkv, NB, bs, D); block_tables: (B, W) int64;
    context_lens: (B,) int64 -> (B, H, D)."""
    return torch.ops.deepserve.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                      context_lens, scale)
