from deepserve.engine.detokenizer import IncrementalDetokenizer
from deepserve.tokenizer import Tokenizer

TEXT = "naïve café → 世界 🙂 done"


def test_pieces_never_split_a_character_and_add_up(tiny_model):
    tok = Tokenizer(tiny_model)
    prompt = tok.encode("print(")
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 3  # byte-level: multi-byte chars span tokens
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == TEXT == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token completed no character


def test_flush_releases_a_broken_tail(tiny_model):
    tok = Tokenizer(tiny_model)
    ids = tok.encode("ok 🙂")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.push(i) for i in ids)
    assert "\ufffd" not in text
    assert text + detok.flush() == tok.decode(ids)
    assert detok.text == tok.decode(ids)
