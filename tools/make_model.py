"""Generate a deterministic random-weight model directory in Hugging Face format.

Usage::

    python tools/make_model.py OUT_DIR [--preset tiny|mini|small] [--arch qwen2|llama]
                               [--seed 0] [--dtype float32|bfloat16] [--shards N]

The directory holds ``config.json``, ``generation_config.json``, the weights
(``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` shards plus
``model.safetensors.index.json``), and a byte-level BPE tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with a ChatML template,
``special_tokens_map.json``) trained offline on the Python standard library's
own ``.py`` sources (sorted by path, capped per preset; padded with
``<|reserved_N|>`` tokens in the unlikely case it yields too few merges).  The
same command writes byte-identical files on the same Python/torch/tokenizers
installation (the stdlib text and the RNG streams are the inputs).

Weights are random but initialised so that greedy decoding is well defined:
the LM head is scaled so logits have a standard deviation of about
``LOGIT_STD``, which leaves clear gaps between the top-1 and top-2 logits;
projections use gains above 1 (sharp attention, strongly nonlinear MLP, layer
outputs that outweigh a tied embedding) so greedy text does not collapse into
repeating one token; and RMSNorm weights and qwen2 q/k/v biases are randomly
perturbed so an engine that ignores them is caught by comparison tests.

This tool is standalone: it imports neither ``deepserve`` nor ``transformers``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Initialisation scheme (see module docstring); all std values are for N(0, std^2).
LOGIT_STD = 4.0  # lm_head std = LOGIT_STD / sqrt(hidden): logits ~ N(0, LOGIT_STD^2)
EMBED_STD = 1.0  # untied input embeddings
PROJ_GAIN = 2.0  # q/k/v/gate/up std = PROJ_GAIN / sqrt(fan_in): sharp attention, nonlinear MLP
OUT_GAIN = 2.0  # o_proj/down_proj std = OUT_GAIN / sqrt(fan_in): layers outweigh a tied embedding
NORM_JITTER = 0.1  # RMSNorm weights = 1 + NORM_JITTER * N(0, 1)
BIAS_STD = 0.1  # qwen2 q/k/v biases


@dataclasses.dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    tie_qwen2: bool
    tie_llama: bool
    corpus_bytes: int  # how much stdlib source text trains the tokenizer


PRESETS = {
    "tiny": Preset(128, 352, 4, 4, 2, 32, 2048, 2048, "float32", True, False, 2_000_000),
    "small": Preset(896, 4864, 24, 14, 2, 64, 32000, 4096, "bfloat16", True, True, 8_000_000),
    # ~77 M parameters: a shape where per-step overhead, not the GEMMs, dominates
    "mini": Preset(512, 2048, 16, 8, 2, 64, 32000, 4096, "bfloat16", True, True, 8_000_000),
}


def stdlib_corpus(max_bytes: int) -> list[str]:
    """Return the stdlib's .py sources (sorted by path) up to ``max_bytes`` of text."""
    root = Path(os.__file__).parent
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts
                   and "dist-packages" not in p.parts)
    texts, total = [], 0
    for path in paths:
        text = path.read_bytes().decode("utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int, corpus_bytes: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_corpus(corpus_bytes), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing < 0:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > {vocab_size}")
    # Pad with reserved special tokens if the corpus yielded too few merges.
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    for token in SPECIAL_TOKENS:
        if len(tok.encode(token).ids) != 1:
            raise RuntimeError(f"special token {token} is not a single token")
    return tok


def tensor_specs(p: Preset, arch: str, tie: bool) -> list[tuple[str, tuple, float, float]]:
    """List (name, shape, std, mean) for every weight, in canonical model order."""
    h, inter = p.hidden_size, p.intermediate_size
    q_out, kv_out = p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    proj = PROJ_GAIN / h**0.5
    lm_std = LOGIT_STD / h**0.5
    specs = [("model.embed_tokens.weight", (p.vocab_size, h), lm_std if tie else EMBED_STD, 0.0)]
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        specs.append((pre + "input_layernorm.weight", (h,), NORM_JITTER, 1.0))
        for name, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            specs.append((f"{pre}self_attn.{name}_proj.weight", (rows, h), proj, 0.0))
            if arch == "qwen2":
                specs.append((f"{pre}self_attn.{name}_proj.bias", (rows,), BIAS_STD, 0.0))
        specs.append((pre + "self_attn.o_proj.weight", (h, q_out), OUT_GAIN / q_out**0.5, 0.0))
        specs.append((pre + "post_attention_layernorm.weight", (h,), NORM_JITTER, 1.0))
        specs.append((pre + "mlp.gate_proj.weight", (inter, h), proj, 0.0))
        specs.append((pre + "mlp.up_proj.weight", (inter, h), proj, 0.0))
        specs.append((pre + "mlp.down_proj.weight", (h, inter), OUT_GAIN / inter**0.5, 0.0))
    specs.append(("model.norm.weight", (h,), NORM_JITTER, 1.0))
    if not tie:
        specs.append(("lm_head.weight", (p.vocab_size, h), lm_std, 0.0))
    return specs


def make_weights(specs: list, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Draw every tensor from one seeded generator, in order, in float32, then cast."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape, std, mean in specs:
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean
        weights[name] = t.to(dtype).contiguous()
    return weights


def split_shards(weights: dict[str, torch.Tensor], n: int) -> list[list[str]]:
    """Split names (in order) into ``n`` non-empty groups of roughly equal bytes."""
    names = list(weights)
    if not 1 <= n <= len(names):
        raise ValueError(f"--shards must be between 1 and {len(names)}")
    sizes = [weights[k].numel() * weights[k].element_size() for k in names]
    target, shards, acc = sum(sizes) / n, [[]], 0
    for idx, (name, size) in enumerate(zip(names, sizes)):
        left_names, left_shards = len(names) - idx, n - len(shards) + 1
        if shards[-1] and (acc >= target * len(shards) or left_names < left_shards):
            shards.append([])
        shards[-1].append(name)
        acc += size
    return shards


def save_weights(out: Path, weights: dict[str, torch.Tensor], n_shards: int) -> None:
    """Write a single safetensors file, or ``n_shards`` shards plus an index."""
    meta = {"format": "pt"}
    if n_shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for k, names in enumerate(split_shards(weights, n_shards), start=1):
        fname = f"model-{k:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: weights[n] for n in names}, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    write_json(out / "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": weight_map})


def rope_config(arch: str) -> dict:
    """qwen2 uses the older ``rope_theta`` spelling; llama the transformers-5 one."""
    if arch == "qwen2":
        return {"rope_theta": 1000000.0}
    return {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}


def model_config(p: Preset, arch: str, tie: bool, dtype: str, ids: dict) -> dict:
    """Build an HF-style config.json dict."""
    cls = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    return {
        "architectures": [cls], "model_type": arch,
        "hidden_size": p.hidden_size, "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads, "head_dim": p.head_dim,
        "vocab_size": p.vocab_size, "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": tie,
        "attention_bias": arch == "qwen2", "attention_dropout": 0.0,
        **rope_config(arch), "dtype": dtype,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"], "use_cache": True,
    }


def write_tokenizer_files(out: Path, tok: Tokenizer, max_len: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tok.save(str(out / "tokenizer.json"), pretty=True)
    special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    write_json(out / "tokenizer_config.json", {
        **special, "tokenizer_class": "PreTrainedTokenizerFast",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": max_len, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE})
    write_json(out / "special_tokens_map.json", {
        "eos_token": special["eos_token"], "pad_token": special["pad_token"],
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def make_model(out: Path, preset: str, arch: str, seed: int, dtype: str | None,
               shards: int, max_position: int | None = None) -> int:
    """Write the whole model directory; return the parameter count.
    max_position: the preset's max_position_embeddings replaced (longer prompts)."""
    p = PRESETS[preset]
    if max_position is not None:
        p = dataclasses.replace(p, max_position_embeddings=max_position)
    dtype = dtype or p.dtype
    tie = p.tie_qwen2 if arch == "qwen2" else p.tie_llama
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(p.vocab_size, p.corpus_bytes)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    weights = make_weights(tensor_specs(p, arch, tie), seed, DTYPES[dtype])
    save_weights(out, weights, shards)
    write_tokenizer_files(out, tok, p.max_position_embeddings)
    write_json(out / "config.json", model_config(p, arch, tie, dtype, ids))
    write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"]})
    return sum(t.numel() for t in weights.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="directory to create or overwrite")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: float32 for tiny, bfloat16 for small")
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    ap.add_argument("--max-position", type=int, default=None,
                    help="max_position_embeddings (default: the preset's)")
    args = ap.parse_args(argv)
    if args.shards < 1:
        ap.error("--shards must be at least 1")
    if args.max_position is not None and not 16 <= args.max_position <= 1 << 20:
        ap.error("--max-position must be in 16..1048576")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    # Build beside the target and rename at the end, so an interrupted run
    # never leaves a directory that looks like a complete model.
    out = args.out_dir.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        n_params = make_model(staging, args.preset, args.arch, args.seed, args.dtype, args.shards,
                              args.max_position)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"{args.out_dir} params={n_params} seconds={time.perf_counter() - start:.2f}")


if __name__ == "__main__":
    main()
