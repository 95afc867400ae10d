"""ModelConfig: the parts of a Hugging Face `config.json` the decoder needs.

One frozen record for every supported family: the fields a family does not
use keep their Llama defaults (no q/k norm, no sliding window, no MoE), so
the shared layers read flags, not model types. What each family's
`config.json` means is read in model/architectures.py; this module holds the
records, the rope spellings and the directory checks.

Both rope spellings are read: the older top-level `rope_theta` +
`rope_scaling`, and the newer (transformers 5) `rope_parameters` dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deepserve.errors import ModelLoadError
from deepserve.model.quant_config import QuantMethod, quant_method

if TYPE_CHECKING:
    import torch

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""dtype name -> bytes per element. Names, not torch dtypes: a process that
only plans (a TE server, a pre-warmed pod, the master's block math) reads the
config without importing torch (~1.5 s of CPU each on 2 cores)."""

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    """One rope table's parameters (model/rope.py builds it).

    theta: base; rope_type: one of ROPE_TYPES; factor: the scaling factor
    (linear, dynamic, yarn, llama3; longrope derives its own);
    original_max_position_embeddings: the pretraining context the scaling
    extends (llama3, yarn, longrope, dynamic); low/high_freq_factor: llama3's
    band; beta_fast/beta_slow, mscale, mscale_all_dim, truncate: yarn's;
    short_factor/long_factor: longrope's per-frequency divisors;
    attention_factor: the cos/sin multiplier (yarn, longrope), None derives it.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: each token runs top_k of num_experts experts.

    intermediate_size: one expert's; norm_topk_prob: renormalise the top-k
    router weights to sum to 1; sparse_layers: per layer, True where the MLP
    is the MoE block (others are the dense MLP of intermediate_size);
    naming: the checkpoint's tensor names, "qwen3_moe" (mlp.gate,
    mlp.experts.j.gate_proj/up_proj/down_proj) or "mixtral"
    (block_sparse_moe.gate, block_sparse_moe.experts.j.w1/w3/w2).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    naming: str


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    dtype_name: str
    """A DTYPE_SIZES key."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    """The gated MLP's activation: "silu" or "gelu_pytorch_tanh"."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)."""
    norm_offset: float = 0.0
    """Added to every RMSNorm weight at load: Gemma scales by (1 + w)."""
    sandwich_norms: bool = False
    """Gemma 3: the attention output is normed before its residual add, and the
    MLP has a norm before (pre_feedforward) and after (post_feedforward)."""
    embed_scale: float = 1.0
    """Embeddings are multiplied by this (Gemma: sqrt(hidden), in the weights' dtype)."""
    attn_scale: float | None = None
    """Softmax scale of q.k; None: head_dim ** -0.5."""
    attn_softcap: float | None = None
    """Attention scores become tanh(s / c) * c (None: off)."""
    final_softcap: float | None = None
    """Logits become tanh(l / c) * c (None: off)."""
    sliding_window: int | None = None
    """A sliding layer's query at position p sees keys in (p - window, p]."""
    layer_types: tuple[str, ...] = ()
    """Per layer FULL or SLIDING; () means every layer is FULL."""
    rope_local: RopeConfig | None = None
    """The sliding layers' rope where it differs from `rope` (Gemma 3)."""
    partial_rotary_factor: float = 1.0
    """Rope turns the first head_dim * this dims of each head (Phi-4-mini: 0.75)."""
    fused_checkpoint: bool = False
    """The checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)."""
    moe: MoEConfig | None = None
    quantization: QuantMethod | None = None
    """The checkpoint's own quantization (quantization_config), read by
    model/checkpoint_quants.py; None: plain weights."""

    @property
    def dtype(self) -> "torch.dtype":
        import torch  # here, not at the top: see DTYPE_SIZES

        return getattr(torch, self.dtype_name)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rope table layer `layer` turns q and k by."""
        return self.rope_local if self.rope_local and self.is_sliding(layer) else self.rope

    def kv_bytes_per_block(self, block_size: int, tp_size: int = 1) -> int:
        """Bytes one KV block takes on one rank, which holds num_kv_heads / tp_size
        heads (K and V of every layer); ValueError naming tp if that is uneven."""
        if self.num_kv_heads % tp_size:
            raise ValueError(f"tensor parallel size tp={tp_size} does not divide "
                             f"num_kv_heads={self.num_kv_heads}")
        local_kv_heads = self.num_kv_heads // tp_size
        return 2 * self.num_layers * block_size * local_kv_heads * self.head_dim * \
            DTYPE_SIZES[self.dtype_name]


def _eos_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    for source in (raw, json.loads(gen.read_text()) if gen.is_file() else {}):
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def load_model_config(model_dir: str | Path, dtype: str | None = None) -> ModelConfig:
    """Parse `model_dir/config.json`; raise ModelLoadError if unusable,
    UnsupportedModelError (naming the model_type) for a family we do not run."""
    from deepserve.model.architectures import architecture_fields

    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{str(model_dir)!r} has no config.json: not a model directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    quantized = raw.get("quantization_config") if isinstance(raw, dict) else None
    method = quant_method(quantized, path) if quantized is not None else None
    try:
        return _build(model_dir, raw, dtype, architecture_fields(raw), method)
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks the field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _build(model_dir: Path, raw: dict, dtype: str | None, fields: dict,
           method: QuantMethod | None) -> ModelConfig:
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    dtype_name = dtype or ("bfloat16" if method else None) or raw.get("dtype") or \
        raw.get("torch_dtype") or "float32"  # a quantized checkpoint runs on bf16 kernels
    if dtype_name not in DTYPE_SIZES:
        raise ModelLoadError(f"dtype {dtype_name!r} is not supported; "
                             f"use one of {sorted(DTYPE_SIZES)}")
    common = dict(
        model_type=raw["model_type"], hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]), num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=False, o_bias=False, dtype_name=dtype_name,
        eos_token_ids=_eos_ids(model_dir, raw), quantization=method)
    common.update(fields)
    return ModelConfig(**common)
