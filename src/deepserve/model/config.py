"""ModelConfig: the parts of a Hugging Face `config.json` the decoder needs.

Both rope spellings are read: the older top-level `rope_theta` +
`rope_scaling`, and the newer (transformers 5) `rope_parameters` dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deepserve.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""dtype name -> bytes per element. Names, not torch dtypes: a process that
only plans (a TE server, a pre-warmed pod, the master's block math) reads the
config without importing torch (~1.5 s of CPU each on 2 cores)."""


@dataclass(frozen=True)
class RopeConfig:
    """theta: base; rope_type: "default" or "llama3"; the rest only for llama3."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def kv_bytes_per_block(self, block_size: int, tp_size: int = 1) -> int:
        """Bytes one KV block takes on one rank, which holds num_kv_heads / tp_size
        heads (K and V of every layer); ValueError naming tp if that is uneven."""
        if self.num_kv_heads % tp_size:
            raise ValueError(f"tensor parallel size tp={tp_size} does not divide "
                             f"num_kv_heads={self.num_kv_heads}")
        local_kv_heads = self.num_kv_heads // tp_size
        return 2 * self.num_layers * block_size * local_kv_heads * self.head_dim * \
            DTYPE_SIZES[self.dtype_name]


def _rope_from(raw: dict) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (default, llama3)")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta), rope_type="llama3", factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]))


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
    """Parse `model_dir/config.json`; raise ModelLoadError if unusable."""
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
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} (architectures {raw.get('architectures')}) is not "
            f"supported; supported: {sorted(SUPPORTED_MODEL_TYPES)}")
    try:
        return _build(model_dir, raw, model_type, dtype)
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks the field {e.args[0]!r}") from e


def _build(model_dir: Path, raw: dict, model_type: str, dtype: str | None) -> ModelConfig:
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    dtype_name = dtype or raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in DTYPE_SIZES:
        raise ModelLoadError(f"dtype {dtype_name!r} is not supported; "
                             f"use one of {sorted(DTYPE_SIZES)}")
    return ModelConfig(
        model_type=model_type, hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]), num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads", num_heads)),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always biases q/k/v (never o); Llama's attention_bias covers all four.
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=model_type == "llama" and bool(raw.get("attention_bias", False)),
        dtype_name=dtype_name, rope=_rope_from(raw), eos_token_ids=_eos_ids(model_dir, raw))
