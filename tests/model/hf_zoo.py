"""Random-weight checkpoints of every supported family, made by transformers
itself from configs of our choice (the oracle builds them, we load them).

Shapes vary on purpose: odd head counts, head_dim != hidden / heads, GQA 1:1,
3:1 and 4:1, sliding windows shorter than the prompts, Gemma's local/global
rope and soft caps, Phi-3's longrope and partial rotary, MoE with dense
layers between sparse ones, and every rope scaling on Llama. Weights are
re-drawn with gains like tools/make_model.py's (not HF's 0.02 init), so
greedy decoding has clear top-1 gaps and a missed detail changes the tokens.
The tokenizer files come from the project's tiny model (vocab 2048).

Every shape with an even number of query and KV heads (all but
qwen3-odd-heads, llama-linear and llama-dynamic) also splits at tp = 2: its
intermediate sizes, each expert's included, are even too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 2048
_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6,
               bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)

SHAPES: dict[str, tuple[str, dict]] = {
    # name: (model_type, config fields)
    "qwen3-odd-heads": ("qwen3", dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=3, num_key_value_heads=1, head_dim=64)),
    "qwen3-gqa4": ("qwen3", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                 tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(hidden_size=128, intermediate_size=256,
                                       num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=4, head_dim=32, sliding_window=16)),
    "gemma3": ("gemma3_text", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, query_pre_attn_scalar=40, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "phi3-longrope": ("phi3", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=24, max_position_embeddings=1024,
        original_max_position_embeddings=256,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
    "qwen3-moe": ("qwen3_moe", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_local_experts=4, num_experts_per_tok=2)),
    "llama-yarn": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2,
                                 rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 512,
                                                  "rope_theta": 10000.0})),
    "llama-linear": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 10000.0})),
    "llama-dynamic": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                     "rope_theta": 10000.0})),
}
"""shape name -> (model_type, config fields over _COMMON)."""


def hf_config(model_type: str, fields: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**_COMMON, **fields})


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    """make_model.py's gains: projections 2 / sqrt(fan_in), logits ~ N(0, 4^2),
    norm weights jittered around their neutral value (0 for Gemma's 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    gemma = "Gemma" in type(model).__name__
    for name, p in sorted(model.named_parameters()):
        if p.dim() == 1:
            base = 0.0 if gemma or name.endswith("bias") else 1.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            continue
        fan_in = p.shape[-1]
        gain = 4.0 if name.endswith(("lm_head.weight", "embed_tokens.weight")) else 2.0
        if "embed_tokens" in name and not model.config.tie_word_embeddings:
            gain = fan_in ** 0.5  # untied embeddings ~ N(0, 1)
        p.copy_(torch.randn(p.shape, generator=gen) * gain / fan_in ** 0.5)


def make_hf_model(out_dir: Path, shape: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write shape's checkpoint (transformers' save_pretrained) + our tokenizer."""
    from transformers import AutoModelForCausalLM

    model_type, fields = SHAPES[shape]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_type, fields), dtype=torch.float32)
    _redraw(model, seed)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' model on a checkpoint, in eval mode (the oracle)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation, each token from one forward over the
    whole context (no KV cache: its plainest masks, and the very logits a
    divergence is judged by); never stops at EOS."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def zoo_prompt(seed: int, length: int) -> list[int]:
    """Token ids of a test prompt, distinct per seed from the first token on."""
    return [(seed * 131 + i * 37) % 1900 + 50 for i in range(length)]
