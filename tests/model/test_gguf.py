"""GGUF import (deepserve/model/gguf) on files written in the test by the
`gguf` package from the tiny models: the weights are the dequantized
originals, greedy output through deepserve.LLM equals transformers on the
imported directory, refusals name what they refuse, and the cache is keyed
by the file's content."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize
from safetensors.torch import load_file

from deepserve.errors import ModelLoadError, UnsupportedModelError
from deepserve.model.gguf import import_gguf
from deepserve.model.gguf.importer import RECORD
from deepserve.model.gguf.tensors import hf_tensors
from deepserve.model.gguf.hf_config import ARCHITECTURES
from deepserve.model.gguf.vocab import PRE_TOKENIZERS
from deepserve.tokenizer import Tokenizer
from tests.model.gguf_factory import write_gguf


GGUF_ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def imported(model_dirs, zoo_dirs, tmp_path_factory):
    """arch -> (GGUF file, its imported directory, expected fp32 weights by HF name);
    qwen3 is the zoo's odd-heads shape (q/k norms, head_dim != hidden / heads)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    sources = {**model_dirs, "qwen3": zoo_dirs["qwen3-odd-heads"]}
    for arch, model_dir in sources.items():
        path = root / f"tiny-{arch}.gguf"
        shutil.copy(model_dir / "config.json", root / f"{arch}.json")  # the source's
        want = write_gguf(model_dir, path)
        out[arch] = (path, import_gguf(path, root / "cache"), want)
    return out


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_weights_are_the_dequantized_originals(imported, arch):
    """Every tensor, whatever its GGUF type, is the original through that type,
    rounded to bf16, under its HF name; llama's Q/K rows are back in HF order."""
    _, directory, want = imported[arch]
    got = load_file(str(directory / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], torch.from_numpy(w).to(torch.bfloat16)), name
    config = json.loads((directory / "config.json").read_text())
    assert config["tie_word_embeddings"] == ("lm_head.weight" not in want)
    source = json.loads((imported[arch][0].parent / f"{arch}.json").read_text())
    for key in ("model_type", "num_attention_heads", "num_key_value_heads", "hidden_size"):
        assert config[key] == source[key], key
    assert config["head_dim"] == source.get("head_dim", source["hidden_size"] //
                                            source["num_attention_heads"])
    record = json.loads((directory / RECORD).read_text())
    assert record["tensor_types"]["Q4_0"] > 0 and record["tensor_types"]["BF16"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_encodes_as_the_original(imported, model_dirs, arch):
    _, directory, _ = imported[arch]
    ours, original = Tokenizer(directory), Tokenizer(model_dirs[arch])
    for text in ["def f(x):\n    return x  # 12345", "naïve café 😀", "<|im_start|>user\nhi"]:
        assert ours.encode(text) == original.encode(text)
    chat = [{"role": "user", "content": "Hello there"}]
    assert ours.apply_chat_template(chat) == original.apply_chat_template(chat)
    assert ours.eos_token == "<|im_end|>"


def test_add_bos_token_puts_bos_in_front_once(model_dirs, tmp_path):
    """tokenizer.ggml.add_bos_token: tokenizer.json's post-processor adds BOS
    to a raw prompt (and tokenizer_config says so), never twice, never to a
    chat prompt encoded without special tokens."""
    from gguf import GGUFReader

    from deepserve.model.gguf.hf_config import Metadata
    from deepserve.model.gguf.vocab import build_tokenizer, tokenizer_config

    write_gguf(model_dirs["qwen2"], tmp_path / "bos.gguf", types={}, add_bos=True)
    meta = Metadata(GGUFReader(tmp_path / "bos.gguf"), "bos.gguf")
    build_tokenizer(meta).save(str(tmp_path / "tokenizer.json"))
    config = tokenizer_config(meta)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    bos = tok.token_to_id(config["bos_token"])
    plain = tok.encode("def f(x):", add_special_tokens=False)
    assert config["add_bos_token"] is True and bos is not None
    assert tok.encode("def f(x):") == [bos, *plain] and bos not in plain


@pytest.mark.slow  # transformers
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_greedy_equals_transformers_on_the_imported_directory(imported, arch):
    """deepserve.LLM given the .gguf file itself (a cache hit: the imported
    directory) against transformers on that directory, fp32."""
    from transformers import AutoModelForCausalLM

    from deepserve import LLM, SamplingParams

    path, directory, _ = imported[arch]
    prompts = [[5, 17, 300, 42, 8, 99], list(range(100, 140))]
    before = sorted(directory.parent.iterdir())
    llm = LLM(str(path), gguf_cache_dir=str(directory.parent), dtype="float32",
              num_kv_blocks=64)
    assert sorted(directory.parent.iterdir()) == before
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.no_grad():  # plain argmax steps: no EOS rule on either side
            for _ in range(12):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt):]


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["x", "Ġ2024", "Ġcan", "'t"]),
    ("smollm", ["x", "Ġ", "2", "0", "2", "4", "Ġcan", "'t"]),  # digits one by one
    ("llama-bpe", ["x", "Ġ", "202", "4", "Ġcan", "'t"]),  # up to three digits
    ("qwen2", ["x", "Ġ", "2", "0", "2", "4", "Ġcan", "'t"]),
])
def test_each_pre_tokenizer_splits_as_its_family(pre, pieces):
    split = PRE_TOKENIZERS[pre](False).pre_tokenize_str("x 2024 can't")
    assert [piece for piece, _ in split] == pieces


def test_k_quant_tensors_are_dequantized(tmp_path):
    """Q4_K, Q5_K and Q6_K (which gguf can read but not write): random blocks
    with small scales, read back as gguf.quants.dequantize gives them."""
    from gguf import GGUFReader

    rng = np.random.default_rng(0)
    path, raw = tmp_path / "k.gguf", {}
    writer = GGUFWriter(str(path), "llama")
    for i, qtype in enumerate((Q.Q4_K, Q.Q5_K, Q.Q6_K)):
        raw[qtype] = _k_blocks(rng, qtype, rows=3, cols=512)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", raw[qtype], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = {"num_attention_heads": 1, "num_key_value_heads": 1}
    got = dict(hf_tensors(GGUFReader(path), ARCHITECTURES["llama"], config))
    for i, qtype in enumerate((Q.Q4_K, Q.Q5_K, Q.Q6_K)):
        w = got[f"model.layers.{i}.mlp.up_proj.weight"]  # (out, in)
        assert w.shape == (3, 512) and np.isfinite(w).all() and np.abs(w).max() > 0
        assert np.array_equal(w, dequantize(raw[qtype], qtype).reshape(3, 512))


def _k_blocks(rng, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random K-quant blocks (256 values each) whose fp16 scales are small and finite."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    # fp16 scales: Q4_K / Q5_K begin with d, dmin; Q6_K ends with d.
    for at in ((0, 2) if qtype in (Q.Q4_K, Q.Q5_K) else (type_size - 2,)):
        blocks[:, at:at + 2] = scale
    return blocks.reshape(rows, -1)


def _minimal_gguf(path, arch: str, qtype: Q = Q.F32, tokenizer: str | None = None) -> None:
    writer = GGUFWriter(str(path), arch)
    if tokenizer:
        writer.add_tokenizer_model(tokenizer)
    data = np.zeros((4, 256), np.float32)
    if qtype != Q.F32:
        import gguf

        data = np.zeros((4, 256 // gguf.GGML_QUANT_SIZES[qtype][0] *
                         gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
    writer.add_tensor("token_embd.weight", data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    _minimal_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(UnsupportedModelError,
                       match="'mamba'.*supported: \\['llama', 'qwen2', 'qwen3'\\]"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing left behind


def test_an_unknown_tensor_type_is_refused_by_name(tmp_path):
    _minimal_gguf(tmp_path / "m.gguf", "llama", Q.Q2_K)
    with pytest.raises(UnsupportedModelError, match="token_embd.weight has GGUF type Q2_K"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "cache")


def test_a_tokenizer_model_we_do_not_build_is_refused_by_name(tmp_path):
    _minimal_gguf(tmp_path / "m.gguf", "llama", tokenizer="llama")
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama' is not supported"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "cache")


def test_the_cache_is_keyed_by_content(imported, tmp_path, monkeypatch):
    """Same bytes under another name: a hit (nothing converted). One byte
    changed: a miss, another directory. A missing file: a typed error."""
    path, directory, _ = imported["qwen2"]
    cache = directory.parent
    renamed = tmp_path / "other-name.gguf"
    shutil.copy(path, renamed)
    import deepserve.model.gguf.convert as convert

    real = convert.convert
    monkeypatch.setattr(convert, "convert", lambda *a: pytest.fail("converted on a hit"))
    assert import_gguf(renamed, cache) == directory
    data = bytearray(renamed.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor
    renamed.write_bytes(bytes(data))
    monkeypatch.setattr(convert, "convert", real)
    changed = import_gguf(renamed, cache)
    assert changed != directory and (changed / RECORD).is_file()
    with pytest.raises(ModelLoadError, match="does not exist"):
        import_gguf(tmp_path / "absent.gguf", cache)


def test_a_named_directory_is_reimported_only_when_the_file_changes(imported, tmp_path,
                                                                    monkeypatch):
    """import_gguf_to (bin/deepserve-up's built-in model): kept while the
    file's bytes are the same, replaced whole when they change."""
    import deepserve.model.gguf.convert as convert
    from deepserve.model.gguf import import_gguf_to
    from deepserve.model.gguf.importer import file_digest, read_record

    out = tmp_path / "models" / "named"
    first, second = imported["qwen2"][0], imported["llama"][0]
    assert import_gguf_to(first, out) == out
    assert read_record(out)["sha256"] == file_digest(first)
    real = convert.convert
    monkeypatch.setattr(convert, "convert", lambda *a: pytest.fail("converted again"))
    assert import_gguf_to(first, out) == out
    monkeypatch.setattr(convert, "convert", real)
    import_gguf_to(second, out)
    assert read_record(out)["sha256"] == file_digest(second)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in out.parent.iterdir()] == ["named"]  # no temporary left


def test_two_imports_at_once_end_with_one_directory(imported, tmp_path):
    """Each writes its own temporary directory; one rename wins, the other's
    copy is dropped, and both callers get the finished directory."""
    path = imported["llama"][0]
    results, errors = [], []

    def run():
        try:
            results.append(import_gguf(path, tmp_path / "cache"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [results[0].name]
