"""Tokenizer.token_bytes: the exact bytes of one token, checked against the
tokenizers' own decoding. A byte-level vocabulary (SmolLM2) against
transformers' AutoTokenizer over the whole vocabulary; sentencepiece-style
vocabularies (Llama 2 / Mistral, Gemma, a Metaspace decoder without byte
fallback), which no model in models/ has, as handmade tokenizer.json files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from deepserve.tokenizer import Tokenizer



def _random_sequences(rng: random.Random, vocab_size: int, n: int):
    for _ in range(n):
        yield [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from transformers import AutoTokenizer
    return Tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_byte_level_bytes_are_the_vocabulary_through_gpt2s_table(smol):
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    ours, hf = smol
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {i: t.content for i, t in hf.added_tokens_decoder.items()}
    ids = list(range(ours.vocab_size))
    assert len(ids) == len(hf)
    for token_id, piece in zip(ids, hf.convert_ids_to_tokens(ids)):
        expected = added[token_id].encode() if token_id in added \
            else bytes(byte_of[c] for c in piece)
        assert ours.token_bytes(token_id) == expected, token_id
    assert ours.token_bytes(10 ** 9) == b"" and ours.token_bytes(-1) == b""


def test_byte_level_bytes_join_to_what_transformers_decodes(smol):
    ours, hf = smol
    rng = random.Random(0)
    num_checked = 0
    for ids in _random_sequences(rng, ours.vocab_size, 400):
        try:
            text = b"".join(ours.token_bytes(i) for i in ids).decode()
        except UnicodeDecodeError:
            continue  # a partial character: no text to compare
        assert text == hf.decode(ids, skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False), ids
        num_checked += 1
    assert num_checked > 300
    # a partial character: its own bytes, which join with the next token's
    [e_acute] = [i for i in range(ours.vocab_size) if ours.token_bytes(i) == b"\xc3"][:1]
    assert (ours.token_bytes(e_acute) + b"\xa9").decode() == "é"


# -- sentencepiece-style vocabularies ---------------------------------------------------
_PIECES = ["▁hello", "▁world", "▁", "a", "é", "▁▁", "ab", "▁日本"]
_LLAMA2 = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])
_GEMMA = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                            decoders.Fuse()])


def _sentencepiece_dir(tmp_path: Path, decoder, byte_fallback: bool = True) -> Path:
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [(piece, -1.0 - i) for i, piece in enumerate(_PIECES)]
    tok = HFTokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=byte_fallback))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoder
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return tmp_path


@pytest.mark.parametrize("decoder", [_LLAMA2, _GEMMA], ids=["llama2", "gemma"])
def test_sentencepiece_bytes(tmp_path, decoder):
    tok = Tokenizer(_sentencepiece_dir(tmp_path, decoder))
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    spell = {tok.token_to_id(p): p.replace("▁", " ").encode() for p in _PIECES}
    spell |= {tok.token_to_id(f"<0x{b:02X}>"): bytes([b]) for b in range(256)}
    spell |= {tok.token_to_id(t): t.encode() for t in ("<s>", "</s>", "<unk>")}
    assert {i: tok.token_bytes(i) for i in spell} == spell
    ids = tok.encode("hello world 日本 ü", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == " hello world 日本 ü".encode()
    # a leading space is the token's own: decode() strips it only at a text's start
    # (llama2's Strip), so a token in front keeps it in the oracle's text too
    a = tok.token_to_id("a")
    rng = random.Random(1)
    for seq in _random_sequences(rng, tok.vocab_size, 300):
        try:
            text = b"".join(tok.token_bytes(i) for i in seq).decode()
        except UnicodeDecodeError:
            continue
        assert "a" + text == hf.decode([a, *seq], skip_special_tokens=False), seq


def test_metaspace_without_byte_fallback_keeps_byte_pieces_as_text(tmp_path):
    tok = Tokenizer(_sentencepiece_dir(tmp_path, decoders.Metaspace(), byte_fallback=False))
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    byte_piece, hello = tok.token_to_id("<0x41>"), tok.token_to_id("▁hello")
    assert tok.token_bytes(byte_piece) == b"<0x41>" and tok.token_bytes(hello) == b" hello"
    a = tok.token_to_id("a")
    assert hf.decode([a, hello, byte_piece]) == "a hello<0x41>"


def test_another_decoder_spells_a_token_as_it_decodes(tmp_path):
    tok = HFTokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(tmp_path)
    assert [ours.token_bytes(i) for i in range(3)] == [b"[UNK]", b"hi", b"there"]
