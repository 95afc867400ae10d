"""The C++ kernels (model/csrc) when they are built, the torch path when not.

Ops for CPUs with AVX2 + FMA (checked before loading):

  * linear_bf16: bf16 weights, fp32 arithmetic (see csrc/linear.cpp), on
    weights packed once at load time by pack_linear_weight;
  * linear_w8: int8 weights with a scale per group of input features of each
    output column (model/quantize.py), packed by pack_linear_w8: the same
    panels and fp32 arithmetic, or int8 activations and int32 sums
    (csrc/linear_vnni.cpp: AVX-512 VNNI or AVX2);
  * paged_decode_attention: one query token per sequence over the paged KV
    pool, read in place (see csrc/decode_attention.cpp);
  * add_rms_norm, rotary, silu_and_mul: a decoder layer's elementwise
    chains fused, for bf16 activations, rounding where the torch ops round
    (see csrc/elementwise.cpp); `fused(t)` says whether they take t.

The library is built at install time (model/build_kernels.py); nothing here
compiles. DEEPSERVE_KERNELS=0 turns the kernels off (the torch path, for
comparisons); a missing or unloadable library does the same, with one log
line saying why.
"""

from __future__ import annotations

import contextlib
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


def start_flushing_denormals() -> None:
    """Torch's intra-op threads treat denormal floats as zero (FTZ + DAZ)
    from now on; the calling thread only inside `denormals_flushed()`.

    Random and real weights alike produce denormals (softmax tails, squares
    of small activations), and x86 cores take a microcode assist per denormal
    operand: on the small preset a 512-token prefill took 7.3 s with them and
    0.9-1.0 s without (this function plus denormals_flushed). The mode is per thread and a thread inherits it when it is
    created, so it is on while a parallel op makes torch start its threads
    (call this after torch.set_num_threads, before any other parallel op).
    The calling thread also runs Python, where DAZ would make a denormal
    float compare equal to 0 (a top_p of 5e-324 would read as 0): there it
    is on only around the model's forward pass.
    """
    torch.set_flush_denormal(True)
    torch.ones(1 << 20).add_(1)  # parallel: torch's threads start now, with the mode
    torch.set_flush_denormal(False)


@contextlib.contextmanager
def denormals_flushed():
    """FTZ + DAZ on the calling thread for the block (see start_flushing_denormals)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def kernel_max_rows() -> int | None:
    """Rows up to which linear_bf16 beats torch's matmul; None: always.

    On CPUs without bf16 arithmetic (Zen 3, AVX2 only) torch's bf16 matmul is
    a slow fallback and the kernel wins at every size. On CPUs with native
    bf16 dot products (AVX512_BF16, AMX) oneDNN's bf16 GEMM wins from about 4
    rows: on an AVX512_BF16 EPYC, (1152 x 896) took 0.047 / 0.076 ms (kernel /
    torch) at 1 row, 0.058 / 0.061 at 4, 0.120 / 0.092 at 8, and at 512 rows
    the kernel ran at 160 GFLOP/s against torch's 570-720. There the kernel
    serves decode steps of up to 3 sequences (memory-bound: it streams the
    packed weight at about twice torch's GEMV speed) and torch the rest.
    """
    has = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731
    if has("_is_avx512_bf16_supported") or has("_is_amx_tile_supported"):
        return 3
    return None


def fused(t: torch.Tensor) -> bool:
    """The fused elementwise ops take this activation (bf16, kernels loaded);
    fp32 models keep the torch ops (the exact-parity path)."""
    return t.dtype == torch.bfloat16 and available()


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += x in place (bf16; x None: no add); returns RMSNorm(residual) * weight."""
    return torch.ops.deepserve.add_rms_norm(x, residual, weight, eps)


def rotary(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rotate the q and k parts of each fused qkv row in place."""
    torch.ops.deepserve.rotary(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) -> (T, I): silu(gate) * up."""
    return torch.ops.deepserve.silu_and_mul(gate_up)


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


def int8_activations() -> bool:
    """int8 weights are packed for int8 activations (csrc/linear_vnni.cpp, as
    llama.cpp's Q8_0 dot products: AVX-512 VNNI where the CPU has it, else
    AVX2) unless $DEEPSERVE_INT8_ACTIVATIONS is "0", which keeps activations in
    fp32 (the weights-only path: exact products of the int8 weights)."""
    return os.environ.get("DEEPSERVE_INT8_ACTIVATIONS", "1") != "0"


def int8_isa() -> str:
    """Which int8-activation path runs here: "avx512-vnni" or "avx2"
    ($DEEPSERVE_KERNEL_ISA=avx2 keeps the AVX2 one on a VNNI CPU)."""
    return "avx512-vnni" if torch.ops.deepserve.vnni_supported() else "avx2"


def pack_linear_w8(q: torch.Tensor, scales: torch.Tensor,
                   a8: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int8 and its (N, K / G) group scales -> what linear_w8 takes; the
    last panel is zero-padded (its scales 1).

    fp32 activations: panels (ceil(N / 16), K, 16) (panel p, row k, byte j:
    column 16p + j) and scales (ceil(N / 16), K / G, 16) laid out alike. int8
    activations (a8 None: int8_activations(); where 4 divides G): panels
    (NP, K / 4, 64), column j's four k at bytes 4j..4j+3, and scales
    (NP, K / G, 32): the 16 columns' scales, then 128 * scale * the group's sum
    of q (VNNI's unsigned activations' offset, taken back)."""
    n, k = q.shape
    num_panels, groups = -(-n // _PANEL), scales.shape[1]
    if num_panels * _PANEL != n:
        q = torch.cat([q, q.new_zeros(num_panels * _PANEL - n, k)])
        scales = torch.cat([scales, scales.new_ones(num_panels * _PANEL - n, groups)])
    scales = scales.float()
    panel_scales = scales.view(num_panels, _PANEL, groups).permute(0, 2, 1)
    if (int8_activations() if a8 is None else a8) and (k // groups) % 4 == 0:
        sums = q.view(-1, groups, k // groups).sum(dim=2, dtype=torch.int32).float()
        offsets = (128 * scales * sums).view(num_panels, _PANEL, groups).permute(0, 2, 1)
        blocks = q.view(num_panels, _PANEL, k // 4, 4).permute(0, 2, 1, 3)
        return (blocks.reshape(num_panels, k // 4, 4 * _PANEL).contiguous(),
                torch.cat([panel_scales, offsets], dim=2).contiguous())
    return q.view(num_panels, _PANEL, k).permute(0, 2, 1).contiguous(), panel_scales.contiguous()


def pack_linear_w4(q: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) values in [0, 15] and their (N, K / G) scales and mins (4 dividing G)
    -> for linear_w8's int4 path: the int8-activation panels (pack_linear_w8) with
    each 64-byte block's value i in the low nibble of byte i and value i + 32 in
    its high one, (NP, K / 4, 32) uint8; scales (NP, K / G, 48): pack_linear_w8's
    32 floats a group, then the 16 columns' mins (the last panel's: 0)."""
    packed, packed_scales = pack_linear_w8(q, scales, a8=True)
    if packed.shape[-1] != 4 * _PANEL:
        raise ValueError("int4 weights need groups a multiple of 4 input features")
    n, groups = mins.shape
    num_panels = packed.shape[0]
    mins = torch.cat([mins.float(), mins.new_zeros(num_panels * _PANEL - n, groups).float()])
    panel_mins = mins.view(num_panels, _PANEL, groups).permute(0, 2, 1)
    u = packed.view(torch.uint8)
    return ((u[..., :32] | (u[..., 32:] << 4)).contiguous(),
            torch.cat([packed_scales, panel_mins], dim=2).contiguous())


def linear_w8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x: (..., K) bf16 or fp32 -> (..., N) in x's dtype; packed and scales from
    pack_linear_w8 or pack_linear_w4 (weight = its value times its group's scale)."""
    lead = x.shape[:-1]
    out = torch.ops.deepserve.linear_w8(x.reshape(-1, x.shape[-1]), packed, scales, bias,
                                        out_features)
    return out.view(*lead, out_features)


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
