"""tools/make_model.py: deterministic, Hugging Face-shaped, a real tokenizer."""

import hashlib
import json
import subprocess

import pytest
from tokenizers import Tokenizer

from tests.conftest import make_model


def _digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_command_twice_gives_identical_files(tmp_path, model_dirs):
    again = make_model(tmp_path / "again", "llama")
    assert _digests(again) == _digests(model_dirs["llama"])
    other_seed = make_model(tmp_path / "seed1", "llama", "tiny", "--seed", "1")
    assert _digests(other_seed)["model.safetensors"] != _digests(again)["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_presets_and_arch_switch(model_dirs):
    qwen = json.loads((model_dirs["qwen2"] / "config.json").read_text())
    llama = json.loads((model_dirs["llama"] / "config.json").read_text())
    assert qwen["architectures"] == ["Qwen2ForCausalLM"] and qwen["tie_word_embeddings"]
    assert llama["architectures"] == ["LlamaForCausalLM"] and not llama["tie_word_embeddings"]
    assert "rope_theta" in qwen and llama["rope_parameters"]["rope_type"] == "llama3"


def test_tokenizer_round_trips_and_has_single_special_tokens(tiny_model):
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    text = "héllo 世界 🙂\r\n\tdef f(x): return x  # ok"
    assert tok.decode(tok.encode(text).ids) == text
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special).ids) == 1
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert tok.get_vocab_size() == cfg["vocab_size"]


def test_max_position_replaces_the_presets_and_is_bounded(tmp_path, model_dirs):
    long = make_model(tmp_path / "long", "qwen2", "tiny", "--max-position", "8192")
    cfg = json.loads((long / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 8192
    assert _digests(long)["model.safetensors"] == _digests(model_dirs["qwen2"])[
        "model.safetensors"]  # the same weights: only the length changed
    for bad in ("15", str((1 << 20) + 1)):
        with pytest.raises(subprocess.CalledProcessError):
            make_model(tmp_path / f"bad{bad}", "qwen2", "tiny", "--max-position", bad)
    make_model(tmp_path / "edge", "qwen2", "tiny", "--max-position", "16")
