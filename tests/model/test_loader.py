"""Model directories: both rope spellings, shards, and every way to be broken."""

import json
import re
import shutil

import pytest
import torch

from deepserve import LLM, ModelLoadError, SamplingParams, UnsupportedModelError
from deepserve.model.config import load_model_config
from deepserve.model.loader import load_model
from tests.conftest import make_model


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_model, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_both_rope_spellings_read_the_same(model_copy):
    _edit_config(model_copy, rope_parameters=None, rope_scaling=None, rope_theta=12345.0)
    old = load_model_config(model_copy)
    _edit_config(model_copy, rope_theta=None,
                 rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    new = load_model_config(model_copy)
    assert old.rope == new.rope and old.rope.theta == 12345.0
    _edit_config(model_copy, rope_parameters=None, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    scaled = load_model_config(model_copy).rope
    assert scaled.rope_type == "llama3" and scaled.factor == 8.0 and scaled.theta == 500000.0


def test_llama_preset_uses_llama3_rope(model_dirs):
    assert load_model_config(model_dirs["llama"]).rope.rope_type == "llama3"


def test_missing_directory_and_files(tmp_path, model_copy):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path / "empty"))
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(model_copy))


def test_missing_tokenizer(model_copy):
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        LLM(str(model_copy))


def test_truncated_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(model_copy)


def test_corrupt_safetensors_header(model_copy):
    path = model_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # garbage where the JSON header starts
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(model_copy)


def test_missing_tensor_is_named(model_copy):
    from safetensors.torch import load_file, save_file

    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="down_proj"):
        load_model(model_copy)


@pytest.mark.parametrize("quantization, error", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method 'fp8'"),
    ({"bits": 4}, "quant_method '?'"), ("gptq", "must be an object"),
    ({"quant_method": "awq", "bits": 3}, "awq with bits = 3"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq with version = 'gemv'"),
    ({"quant_method": "gptq", "bits": 8}, "gptq with bits = 8"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"},
     "format 'float-quantized'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "no projection has its tensors")])
def test_a_quantized_checkpoint_we_do_not_read_is_refused_naming_it(model_copy, quantization,
                                                                   error):
    """Its shapes may match ours, but its weights need scales we would not read."""
    _edit_config(model_copy, quantization_config=quantization)
    with pytest.raises(ModelLoadError, match=re.escape(error)):
        LLM(str(model_copy))


def test_unsupported_architecture(model_copy):
    _edit_config(model_copy, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="deepseek_v3.*supported.*qwen3_moe"):
        LLM(str(model_copy))


def test_config_without_required_field(model_copy):
    _edit_config(model_copy, hidden_size=None)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model_config(model_copy)


def test_sharded_checkpoint_equals_single_file(tiny_model, tmp_path):
    sharded = make_model(tmp_path / "sharded", "qwen2", "tiny", "--shards", "3")
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load_model(tiny_model), load_model(sharded)
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name
    sp = SamplingParams(temperature=0, max_tokens=8)
    assert LLM(str(sharded)).generate("abc", sp)[0].token_ids == \
        LLM(str(tiny_model)).generate("abc", sp)[0].token_ids


def test_bfloat16_from_option(tiny_model):
    llm = LLM(str(tiny_model), dtype="bfloat16", num_kv_blocks=32)
    assert llm.engine.runner.kv_pool.dtype == torch.bfloat16
    assert next(llm.engine.runner.model.parameters()).dtype == torch.bfloat16
    assert len(llm.generate("abc", SamplingParams(max_tokens=4))[0].token_ids) == 4
