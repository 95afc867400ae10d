"""Quantized Hugging Face checkpoints (model/checkpoint_quants.py): AWQ, GPTQ
and compressed-tensors int8 checkpoints made here from the tiny qwen2, each
projection's weight quantized here (round to nearest, asymmetric int4 in
groups of 32 with integer zero points, or symmetric int8 a channel) and
packed by this file's own loops as each format defines it. Loaded, every projection runs
in the int8 kernel's form of exactly those values, the model follows the
same weights in bf16, and what we do not read is refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deepserve.errors import ModelLoadError
from deepserve.model import kernels
from deepserve.model.config import load_model_config
from deepserve.model.loader import load_model
from deepserve.model.parallel import TensorParallel
from deepserve.model.stored_quants import assemble
from deepserve.model.checkpoint_quants import read_checkpoint_quants
from deepserve.model.loader import checkpoint_files
from deepserve.model.weight_map import checkpoint_targets
from tests.model.logprob_check import assert_follows, prompt_logprobs

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
AWQ_ORDER_SPEC = [0, 2, 4, 6, 1, 3, 5, 7]


def _pack_int32(values: np.ndarray) -> np.ndarray:
    """(..., 8) values in [0, 15] -> (...) int32, value i in bits 4i..4i+3."""
    out = np.zeros(values.shape[:-1], np.uint32)
    for i in range(8):
        out |= values[..., i].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def _awq(q, zeros, scales):
    """q (K, N), zeros / scales (K / G, N) -> AWQ's qweight, qzeros, scales."""
    def pack(m):
        cols = m.reshape(m.shape[0], -1, 8)  # 8 consecutive columns an int
        return _pack_int32(cols[..., AWQ_ORDER_SPEC])  # nibble i: column ORDER[i]
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales.astype(np.float16)}


def _gptq(q, zeros, scales, k):
    """GPTQ ("gptq" format: zero points stored minus one)."""
    rows = q.reshape(-1, 8, q.shape[1]).transpose(0, 2, 1)  # (K/8, N, 8): row 8r + i
    zs = (zeros - 1).reshape(zeros.shape[0], -1, 8)
    return {"qweight": _pack_int32(rows), "qzeros": _pack_int32(zs),
            "scales": scales.astype(np.float16),
            "g_idx": (np.arange(k) // GROUP).astype(np.int32)}


def _quantized_copy(tiny, out, method: str) -> dict[str, torch.Tensor]:
    """Write a quantized checkpoint of tiny's shapes into out; returns the exact
    (N, K) fp32 weight of every projection."""
    shutil.copytree(tiny, out)
    tensors = load_file(str(out / "model.safetensors"))
    exact = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.rsplit(".", 2)[-2] in PROJECTIONS]:
        n, k = tensors[name].shape
        x = name.removesuffix(".weight")
        w = tensors[name].float().numpy()  # the tiny model's weight, quantized as a tool would
        if method == "compressed-tensors":  # symmetric, one scale a channel
            scale = torch.from_numpy(np.abs(w).max(axis=1, keepdims=True) / 127).to(torch.bfloat16)
            q = np.clip(np.round(w / scale.float().numpy()), -128, 127).astype(np.int8)
            q[0, 0] = -128  # the format's whole range
            tensors[name] = torch.from_numpy(q)
            tensors[f"{x}.weight_scale"] = scale
            exact[name] = torch.from_numpy(q).float() * scale.float()
            continue
        groups = w.T.reshape(k // GROUP, GROUP, n)  # (K, N) as the formats store it
        lo, hi = groups.min(axis=1), groups.max(axis=1)
        scales = np.maximum((hi - lo) / 15, 1e-4).astype(np.float16)
        zeros = np.clip(np.round(-lo / scales.astype(np.float32)), 1, 15).astype(np.int64)
        q = np.clip(np.round(groups / scales.astype(np.float32)[:, None]) + zeros[:, None], 0, 15)
        q = q.reshape(k, n).astype(np.int64)
        packed = _awq(q, zeros, scales) if method == "awq" else _gptq(q, zeros, scales, k)
        del tensors[name]
        tensors.update({f"{x}.{key}": torch.from_numpy(np.ascontiguousarray(v))
                        for key, v in packed.items()})
        w = (q - np.repeat(zeros, GROUP, axis=0)) * np.repeat(scales.astype(np.float32),
                                                                GROUP, axis=0)
        exact[name] = torch.from_numpy(np.ascontiguousarray(w.T).astype(np.float32))
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                "zero_point": True},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                 "sym": False},
        "compressed-tensors": {
            "quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}},
            "ignore": ["lm_head"]}}[method]
    (out / "config.json").write_text(json.dumps(config))
    return exact


@pytest.fixture(scope="module")
def checkpoints(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {m: (root / m, _quantized_copy(model_dirs["qwen2"], root / m, m))
            for m in ("awq", "gptq", "compressed-tensors")}


METHODS = ["awq", "gptq", "compressed-tensors"]


@pytest.mark.parametrize("method", METHODS)
def test_every_projection_is_the_checkpoints_values_exactly(checkpoints, method):
    directory, exact = checkpoints[method]
    cfg = load_model_config(directory)
    assert cfg.quantization.name == method and cfg.dtype_name == "bfloat16"
    quants = read_checkpoint_quants(checkpoint_files(directory), cfg.quantization)
    assert quants.weights() == set(exact)
    for name, weight in exact.items():
        assert torch.equal(quants.dequantized(name)[:], weight), name
    # fused as the model fuses them: q/k/v rows, then gate/up
    shapes = {"layers.0.self_attn.qkv_proj.weight": (128 + 2 * 64, 128)}
    tp = TensorParallel()
    fused = assemble(quants, checkpoint_targets(cfg, tp), tp, shapes)
    layer = "model.layers.0.self_attn."
    want = torch.cat([exact[layer + f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(fused["layers.0.self_attn.qkv_proj.weight"].dequantized(), want)


@needs_kernels
@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_checkpoint_runs_in_the_kernel_as_its_bf16_values(checkpoints, method,
                                                                     tmp_path, monkeypatch):
    """Prompt logprobs of the quantized checkpoint against the plain one holding
    the same values in bf16, with the kernel at every size (its int8
    activations are the only difference)."""
    monkeypatch.setattr(kernels, "kernel_max_rows", lambda: None)
    directory, exact = checkpoints[method]
    model = load_model(directory)
    down = model.layers[0].mlp.down_proj
    int4 = method != "compressed-tensors"
    assert down.scales is not None
    assert down.packed.dtype == (torch.uint8 if int4 else torch.int8)
    assert model.lm_head.scales is None  # not quantized in the checkpoint
    plain = tmp_path / "plain"  # the same model, its projections the exact values
    shutil.copytree(directory, plain)
    packing = {"qweight", "qzeros", "scales", "g_idx", "weight_scale"}
    tensors = {k: v for k, v in load_file(str(directory / "model.safetensors")).items()
               if k.rsplit(".", 1)[1] not in packing}
    tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in exact.items()})
    save_file(tensors, str(plain / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    assert_follows(prompt_logprobs(plain), prompt_logprobs(directory))


def test_options_we_do_not_read_are_refused_by_name(checkpoints, tmp_path):
    directory, _ = checkpoints["gptq"]
    with pytest.raises(ModelLoadError, match="quantized already"):
        load_model(directory, quantize="int8")
    with pytest.raises(ModelLoadError, match="a gptq checkpoint needs a bfloat16 model"):
        load_model(directory, "float32")
    shuffled = tmp_path / "act-order"
    shutil.copytree(directory, shuffled)
    tensors = load_file(str(shuffled / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(shuffled / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="act-order"):
        load_model(shuffled)
    missing = tmp_path / "no-zeros"
    shutil.copytree(directory, missing)
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.qzeros"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="k_proj has no qzeros"):
        load_model(missing)
