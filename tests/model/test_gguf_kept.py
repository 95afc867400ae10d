"""GGUF weights kept quantized (model/gguf/blocks.py, model/stored_quants.py,
`quantize = "gguf"`): each kept type's integers and scales are the file's
values bit for bit (gguf.quants.dequantize is the oracle), an import stores
them in HF row order, a TE in gguf mode runs each projection in the file's
own form where all its pieces have one (the rest in bf16), tensor-parallel
shards cut them as the bf16 loader cuts weights, and a directory without
them is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from deepserve.errors import ModelLoadError
from deepserve.model import kernels
from deepserve.model.config import load_model_config
from deepserve.model.decoder import CausalLM
from deepserve.model.gguf import import_gguf
from deepserve.model.gguf.blocks import kept_form
from deepserve.model.loader import load_model
from deepserve.model.parallel import TensorParallel
from deepserve.model.quantize import QuantizedWeight
from deepserve.model.stored_quants import QUANTS_FILE, stored_quants
from deepserve.model.weight_map import checkpoint_targets
from tests.model.gguf_factory import write_gguf
from tests.model.logprob_check import assert_follows, prompt_logprobs
from tests.model.test_gguf import _k_blocks

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
UNIFORM = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_1,
           "attn_v": Q.Q4_1, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1,
           "ffn_down": Q.Q8_0}
"""Every projection of a kind its fused partners share: all kept."""


@pytest.fixture(scope="module")
def imports(model_dirs, tmp_path_factory):
    """name -> (imported directory, expected fp32 weights by HF name): "mixed" is the
    tiny llama in gguf_factory.MIXED's types, "uniform" the tiny qwen2 (tied
    head) in UNIFORM's."""
    root = tmp_path_factory.mktemp("kept")
    out = {}
    for name, arch, types in (("mixed", "llama", None), ("uniform", "qwen2", UNIFORM)):
        path = root / f"{name}.gguf"
        want = write_gguf(model_dirs[arch], path, types)
        out[name] = (import_gguf(path, root / "cache"), want)
    return out


def _dequantized(q, scales, mins) -> np.ndarray:
    weight = QuantizedWeight(torch.from_numpy(q.astype(np.int8)), torch.from_numpy(scales),
                             None if mins is None else torch.from_numpy(mins))
    return weight.dequantized().numpy()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_each_kept_type_is_the_files_values_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 5, 512
    if qtype == Q.Q4_K:
        data = _k_blocks(rng, qtype, rows, cols)
    else:
        w = (rng.standard_normal((rows, cols)) * rng.random((1, cols))).astype(np.float32)
        data = quantize(w, qtype)
    if qtype == Q.Q8_0:  # llama.cpp never writes -128, but a file may hold it
        data = data.copy()
        data[0, 2] = 0x80
    q, scales, mins = kept_form(data, qtype, rows, cols)
    assert q.shape == (rows, cols) and scales.shape == (rows, cols // 32)
    assert (mins is None) == (qtype == Q.Q8_0)
    if mins is not None:
        assert q.min() >= 0 and q.max() <= 15
    else:
        assert q[0, 0] == -128
    assert np.array_equal(_dequantized(q, scales, mins), dequantize(data, qtype).reshape(rows, cols))


def test_an_import_stores_the_kept_tensors_in_hf_row_order(imports):
    directory, want = imports["mixed"]
    stored = load_file(str(directory / QUANTS_FILE))
    names = {key.rsplit(".", 1)[0] for key in stored}
    layer = "model.layers.0."
    assert {layer + "self_attn.q_proj.weight", layer + "self_attn.k_proj.weight",
            layer + "mlp.gate_proj.weight", "model.embed_tokens.weight"} <= names
    assert layer + "self_attn.v_proj.weight" not in names  # F16: bf16 only
    assert layer + "self_attn.o_proj.weight" not in names  # BF16
    for name in (layer + "self_attn.q_proj.weight", layer + "self_attn.k_proj.weight"):
        packed = stored[f"{name}.q"]  # int4: two values a byte
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        got = QuantizedWeight(q.to(torch.int8), stored[f"{name}.scales"],
                              stored[f"{name}.mins"]).dequantized()
        assert torch.equal(got, torch.from_numpy(want[name])), name  # llama's rows unpermuted


@needs_kernels
def test_gguf_mode_runs_each_projection_in_the_files_form(imports):
    directory, want = imports["mixed"]
    model = load_model(directory, quantize="gguf")
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    down = mlp.down_proj
    assert down.scales is not None and down.packed.dtype == torch.uint8  # Q4_0: int4 panels
    assert model.lm_head.scales is None  # untied llama head: F32 in this file
    fused = [m for m in (*attn.children(), *mlp.children())
             if getattr(m, "packed", None) is not None and m is not down]
    assert fused and all(m.scales is None for m in fused)  # q+k+v, gate+up, o: mixed or float
    cfg = load_model_config(directory)
    stored = stored_quants(directory, checkpoint_targets(cfg, TensorParallel()),
                           TensorParallel(), model.linear_shapes())
    name = "layers.0.mlp.down_proj.weight"
    assert sorted(stored) == sorted(f"layers.{i}.mlp.down_proj.weight"
                                    for i in range(cfg.num_layers))
    assert torch.equal(stored[name].dequantized(),
                       torch.from_numpy(want["model.layers.0.mlp.down_proj.weight"]))


@needs_kernels
def test_gguf_mode_follows_the_bf16_import_and_ties_the_head(imports, monkeypatch):
    """The kept weights are the bf16 import's values before rounding, so prompt
    logprobs agree closely, the kernel at every size (it quantizes activations
    per group)."""
    monkeypatch.setattr(kernels, "kernel_max_rows", lambda: None)
    directory, _ = imports["uniform"]
    model = load_model(directory, quantize="gguf")
    assert all(m.scales is not None for m in model.modules() if getattr(m, "packed", None)
               is not None)
    assert model.lm_head.packed.dtype == torch.int8  # the tied Q8_0 embedding
    assert_follows(prompt_logprobs(directory), prompt_logprobs(directory, "gguf"))


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_are_cut_from_the_whole(imports, rank):
    """Rows of q/k/v and gate/up by rank; columns of o_proj and down_proj by
    whole groups (down's 352 inputs split into 176: not whole groups, so it
    keeps bf16 at tp=2)."""
    directory, _ = imports["uniform"]
    cfg = load_model_config(directory)
    whole_tp, tp = TensorParallel(), TensorParallel(rank, 2)
    with torch.device("meta"):
        shapes = CausalLM(cfg, tp).linear_shapes()
        whole_shapes = CausalLM(cfg, whole_tp).linear_shapes()
    whole = stored_quants(directory, checkpoint_targets(cfg, whole_tp), whole_tp, whole_shapes)
    shard = stored_quants(directory, checkpoint_targets(cfg, tp), tp, shapes)
    assert "layers.0.mlp.down_proj.weight" not in shard
    o = "layers.0.self_attn.o_proj.weight"
    cols = cfg.hidden_size // 2
    assert torch.equal(shard[o].dequantized(),
                       whole[o].dequantized()[:, rank * cols:(rank + 1) * cols])
    gate_up = "layers.0.mlp.gate_up_proj.weight"
    inter = cfg.intermediate_size // 2
    full = whole[gate_up].dequantized()
    rows = torch.cat([full[rank * inter:(rank + 1) * inter],
                      full[cfg.intermediate_size + rank * inter:][:inter]])
    assert torch.equal(shard[gate_up].dequantized(), rows)


def test_gguf_mode_needs_a_gguf_import(tiny_model, imports, tmp_path):
    with pytest.raises(ModelLoadError, match=QUANTS_FILE):
        load_model(tiny_model, dtype="bfloat16", quantize="gguf")
    directory, _ = imports["uniform"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in directory.iterdir():
        (broken / f.name).symlink_to(f)
    stored = load_file(str(directory / QUANTS_FILE))
    key = "model.layers.0.mlp.down_proj.weight.scales"
    stored[key] = stored[key][:-1].contiguous()  # a row short
    (broken / QUANTS_FILE).unlink()
    save_file(stored, str(broken / QUANTS_FILE))
    with pytest.raises(ModelLoadError, match="down_proj.weight.scales has shape"):
        load_model(broken, quantize="gguf")
    stored[key] = load_file(str(directory / QUANTS_FILE))[key][:, :-1].contiguous()
    save_file(stored, str(broken / QUANTS_FILE))  # 10 groups for 352 inputs
    with pytest.raises(ModelLoadError, match="scales has 10 groups, which do not divide"):
        load_model(broken, quantize="gguf")
