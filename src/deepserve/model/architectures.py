"""What each supported family's `config.json` means, as ModelConfig fields.

One function per `model_type`; each returns the fields where the family
differs from Llama (biases, q/k norms, sliding windows, Gemma's norms and
scales, Phi-3's fused tensors, MoE). The decoder (model/decoder.py) reads
those flags, never the model type. Torch-free: planners read configs too.

A `model_type` not listed here (MLA, vision towers, ...) is refused with
UnsupportedModelError naming it and the supported list.
"""

from __future__ import annotations

import math
from typing import Callable

from deepserve.errors import UnsupportedModelError
from deepserve.model.config import FULL, ROPE_TYPES, SLIDING, MoEConfig, RopeConfig

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The gated MLP activations model/layers.py runs."""


def architecture_fields(raw: dict) -> dict:
    """ModelConfig fields beyond the common ones, for raw's model_type."""
    model_type = raw.get("model_type")
    parse = ARCHITECTURES.get(model_type)
    if parse is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} (architectures {raw.get('architectures')}) is not "
            f"supported; supported: {sorted(ARCHITECTURES)}")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{model_type}: mlp_bias = true is not supported")
    fields = parse(raw)
    act = fields.get("hidden_act", raw.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{model_type}: hidden_act {act!r} is not supported "
                                    f"{ACTIVATIONS}")
    return {**fields, "hidden_act": act}


def rope_from(params: dict, raw: dict, theta_default: float = 10000.0) -> RopeConfig:
    """A RopeConfig from one rope dict (rope_parameters or rope_scaling, the
    newer or older spelling) and the top-level fields it may leave out."""
    theta = params.get("rope_theta", raw.get("rope_theta", theta_default))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported {ROPE_TYPES}")
    original = params.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings"))
    fields = dict(theta=float(theta), rope_type=rope_type)
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim", "attention_factor"):
        if params.get(name) is not None:
            fields[name] = float(params[name])
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    if "truncate" in params:
        fields["truncate"] = bool(params["truncate"])
    for name in ("short_factor", "long_factor"):
        if params.get(name) is not None:
            fields[name] = tuple(float(f) for f in params[name])
    if rope_type == "longrope" and not fields.get("short_factor"):
        raise UnsupportedModelError("longrope rope scaling without short_factor / long_factor")
    return RopeConfig(**fields)


def _rope_params(raw: dict) -> dict:
    return dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})


def _partial_rotary(raw: dict) -> float:
    return float(_rope_params(raw).get("partial_rotary_factor",
                                       raw.get("partial_rotary_factor", 1.0)))


def _layer_types(raw: dict, window: int | None, default: Callable[[int], str]) -> tuple[str, ...]:
    """Per-layer attention kinds: the config's own list, else `default(i)`;
    () when no layer slides (the shared code's fast path)."""
    n = int(raw["num_hidden_layers"])
    types = tuple(raw.get("layer_types") or (default(i) for i in range(n)))
    if len(types) != n or not set(types) <= {FULL, SLIDING}:
        raise UnsupportedModelError(f"layer_types {list(types)} (want {n} of {FULL!r} / "
                                    f"{SLIDING!r})")
    return types if window and SLIDING in types else ()


def _llama(raw: dict) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, rope=rope_from(_rope_params(raw), raw))


def _all_sliding(raw: dict) -> dict:
    """Mistral, Mixtral, Phi-3: one window for every layer, when set."""
    window = raw.get("sliding_window")
    window = int(window) if window else None
    return dict(sliding_window=window,
                layer_types=_layer_types(raw, window, lambda i: SLIDING))


def _qwen_sliding(raw: dict) -> dict:
    """Qwen2/3: layers from max_window_layers on slide when use_sliding_window."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    first = int(raw.get("max_window_layers", 28))
    return dict(sliding_window=window,
                layer_types=_layer_types(raw, window, lambda i: SLIDING if i >= first else FULL))


def _qwen2(raw: dict) -> dict:
    # Qwen2 always biases q/k/v, never o.
    return dict(qkv_bias=True, rope=rope_from(_rope_params(raw), raw), **_qwen_sliding(raw))


def _qwen3(raw: dict) -> dict:
    return dict(_llama(raw), qk_norm=True, **_qwen_sliding(raw))


def _mistral(raw: dict) -> dict:
    return dict(_llama(raw), **_all_sliding(raw))


def _phi3(raw: dict) -> dict:
    return dict(_llama(raw), fused_checkpoint=True, partial_rotary_factor=_partial_rotary(raw),
                **_all_sliding(raw))


def _gemma3(raw: dict) -> dict:
    params = raw.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # transformers 5: one dict per layer kind
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:  # hub checkpoints: rope_theta + rope_scaling global, rope_local_base_freq local
        full = dict(raw.get("rope_scaling") or {})
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    window = raw.get("sliding_window")
    pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
    bias = bool(raw.get("attention_bias", False))
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("gemma3_text with use_bidirectional_attention")
    hidden = int(raw["hidden_size"])
    return dict(
        qkv_bias=bias, o_bias=bias, qk_norm=True, norm_offset=1.0, sandwich_norms=True,
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        embed_scale=math.sqrt(hidden),
        attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=raw.get("attn_logit_softcapping"),
        final_softcap=raw.get("final_logit_softcapping"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        rope=rope_from(full, {}, 1_000_000.0), rope_local=rope_from(local, {}, 10_000.0),
        sliding_window=int(window) if window else None,
        layer_types=_layer_types(raw, window, lambda i: SLIDING if (i + 1) % pattern else FULL))


def _moe(raw: dict, num_experts: int, naming: str, norm_topk_prob: bool,
         intermediate: int, sparse: Callable[[int], bool]) -> MoEConfig:
    n = int(raw["num_hidden_layers"])
    return MoEConfig(num_experts=num_experts, top_k=int(raw["num_experts_per_tok"]),
                     intermediate_size=intermediate, norm_topk_prob=norm_topk_prob,
                     sparse_layers=tuple(sparse(i) for i in range(n)), naming=naming)


def _qwen3_moe(raw: dict) -> dict:
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or ())
    # the hub's configs say num_experts, transformers 5 writes num_local_experts
    num_experts = int(raw.get("num_experts") or raw["num_local_experts"])
    moe = _moe(raw, num_experts, "qwen3_moe", bool(raw.get("norm_topk_prob", False)),
               int(raw["moe_intermediate_size"]),
               lambda i: i not in dense and step > 0 and (i + 1) % step == 0)
    return dict(_qwen3(raw), moe=moe)


def _mixtral(raw: dict) -> dict:
    # Mixtral always renormalises its top-k router weights; every layer is sparse.
    moe = _moe(raw, int(raw["num_local_experts"]), "mixtral", True,
               int(raw["intermediate_size"]), lambda i: True)
    return dict(_llama(raw), moe=moe, **_all_sliding(raw))


ARCHITECTURES: dict[str, Callable[[dict], dict]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral,
    "phi3": _phi3, "gemma3_text": _gemma3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
}
"""model_type -> its fields. SUPPORTED_MODEL_TYPES lists the keys."""

SUPPORTED_MODEL_TYPES = tuple(sorted(ARCHITECTURES))
