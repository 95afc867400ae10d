"""Where each checkpoint tensor goes: Hugging Face names -> our parameters.

Every family is named like Llama (`model.layers.i.self_attn.q_proj.weight`,
...) plus what it adds: q/k norms (Qwen3, Gemma 3), Gemma's feed-forward
norms, Phi-3's fused `qkv_proj` / `gate_up_proj`, and MoE routers and experts
(`mlp.gate` + `mlp.experts.j.{gate,up,down}_proj` for Qwen3-MoE,
`block_sparse_moe.gate` + `block_sparse_moe.experts.j.w1/w3/w2` for Mixtral).

One checkpoint tensor may fill several pieces (Phi-3's qkv_proj feeds the q,
k and v rows of a rank's fused projection); each piece is a _Target. With
tensor parallelism a piece names the dimension split across ranks and the
section of the checkpoint tensor it comes from, so each rank reads only its
shard (model/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.model.config import ModelConfig
from deepserve.model.parallel import TensorParallel


@dataclass(frozen=True)
class _Target:
    """One piece of one checkpoint tensor.

    param: our parameter; shape: the full checkpoint shape the config implies;
    row: the first row of param (or of param[expert]) the piece fills; dim: the
    dimension split across tp ranks (0: output rows, 1: input columns), None
    when every rank holds the whole tensor; section: (start, rows) of the
    checkpoint tensor's rows this piece is, before splitting (None: all of
    it); expert: the expert index of a stacked MoE parameter; offset: added
    to the values once copied (Gemma's (1 + w) norms).
    """

    param: str
    shape: tuple[int, ...]
    row: int = 0
    dim: int | None = None
    section: tuple[int, int] | None = None
    expert: int | None = None
    offset: float = 0.0


Targets = dict[str, list[_Target]]


def checkpoint_targets(cfg: ModelConfig, tp: TensorParallel) -> Targets:
    """checkpoint tensor name -> the pieces (of this rank's shard) it fills."""
    e, v = cfg.hidden_size, cfg.vocab_size
    out: Targets = {"model.embed_tokens.weight": [_Target("embed_tokens.weight", (v, e))],
                    "model.norm.weight": [_norm("norm.weight", e, cfg)]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [_Target("lm_head.weight", (v, e))]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out.update(_norms(cfg, src, dst))
        out.update(_attention(cfg, tp, src + "self_attn.", dst + "self_attn."))
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            out.update(_experts(cfg, tp, src, dst + "mlp."))
        else:
            out.update(_mlp(cfg, tp, src + "mlp.", dst + "mlp.", cfg.intermediate_size))
    return out


def _norm(param: str, size: int, cfg: ModelConfig) -> _Target:
    return _Target(param, (size,), offset=cfg.norm_offset)


def _norms(cfg: ModelConfig, src: str, dst: str) -> Targets:
    names = ["input_layernorm", "post_attention_layernorm"]
    if cfg.sandwich_norms:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    out = {f"{src}{n}.weight": [_norm(f"{dst}{n}.weight", cfg.hidden_size, cfg)] for n in names}
    if cfg.qk_norm:
        for n in ("q_norm", "k_norm"):
            out[f"{src}self_attn.{n}.weight"] = [
                _norm(f"{dst}self_attn.{n}.weight", cfg.head_dim, cfg)]
    return out


def _fused_rows(param: str, shape: tuple[int, ...], sizes: list[int],
                tp: TensorParallel) -> list[_Target]:
    """Pieces of a tensor whose rows are sections of `sizes` (q, k, v or gate,
    up), each split across ranks and packed one after another in param."""
    pieces, start, row = [], 0, 0
    for size in sizes:
        pieces.append(_Target(param, shape, row, 0, (start, size)))
        start, row = start + size, row + size // tp.size
    return pieces


def _attention(cfg: ModelConfig, tp: TensorParallel, src: str, dst: str) -> Targets:
    e, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    sections = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    out: Targets = {}
    kinds = ["weight"] + (["bias"] if cfg.qkv_bias else [])
    for kind in kinds:
        if cfg.fused_checkpoint:  # Phi-3: one qkv_proj of q + 2 kv rows
            shape = (q + 2 * kv, e) if kind == "weight" else (q + 2 * kv,)
            out[f"{src}qkv_proj.{kind}"] = _fused_rows(
                f"{dst}qkv_proj.{kind}", shape, list(sections.values()), tp)
            continue
        row = 0  # this rank's q rows, then its k rows, then its v rows
        for name, rows in sections.items():
            shape = (rows, e) if kind == "weight" else (rows,)
            out[f"{src}{name}.{kind}"] = [_Target(f"{dst}qkv_proj.{kind}", shape, row, 0)]
            row += rows // tp.size
    out[f"{src}o_proj.weight"] = [_Target(f"{dst}o_proj.weight", (e, q), dim=1)]
    if cfg.o_bias:  # replicated: RowParallelLinear adds it once, after the all-reduce
        out[f"{src}o_proj.bias"] = [_Target(f"{dst}o_proj.bias", (e,))]
    return out


def _mlp(cfg: ModelConfig, tp: TensorParallel, src: str, dst: str, inter: int) -> Targets:
    e = cfg.hidden_size
    gate_up = f"{dst}gate_up_proj.weight"
    out: Targets = {f"{src}down_proj.weight": [_Target(f"{dst}down_proj.weight", (e, inter),
                                                       dim=1)]}
    if cfg.fused_checkpoint:  # Phi-3: one gate_up_proj, gate rows first
        out[f"{src}gate_up_proj.weight"] = _fused_rows(gate_up, (2 * inter, e), [inter, inter], tp)
    else:
        out[f"{src}gate_proj.weight"] = [_Target(gate_up, (inter, e), 0, 0)]
        out[f"{src}up_proj.weight"] = [_Target(gate_up, (inter, e), inter // tp.size, 0)]
    return out


_EXPERT_NAMES = {  # naming -> (block, router, gate, up, down)
    "qwen3_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
}


def _experts(cfg: ModelConfig, tp: TensorParallel, src: str, dst: str) -> Targets:
    moe, e = cfg.moe, cfg.hidden_size
    block, router, gate, up, down = _EXPERT_NAMES[moe.naming]
    inter = moe.intermediate_size
    out: Targets = {f"{src}{block}.{router}.weight": [_Target(f"{dst}gate.weight",
                                                              (moe.num_experts, e))]}
    for j in range(moe.num_experts):
        base = f"{src}{block}.experts.{j}."
        out[f"{base}{gate}.weight"] = [_Target(f"{dst}gate_up", (inter, e), 0, 0, expert=j)]
        out[f"{base}{up}.weight"] = [_Target(f"{dst}gate_up", (inter, e), inter // tp.size, 0,
                                             expert=j)]
        out[f"{base}{down}.weight"] = [_Target(f"{dst}down", (e, inter), dim=1, expert=j)]
    return out
