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


def test_include_stop_str_in_output_and_skip_special_tokens(tiny_model):
    from deepserve.engine.output_processor import RequestState
    from deepserve.messages.sampling import SamplingParams
    from deepserve.tokenizer import Tokenizer
    tok = Tokenizer(tiny_model)
    ids = tok.encode("hello world, and more", add_special_tokens=False)
    for include, want in ((False, "hello"), (True, "hello world")):
        state = RequestState("r", None, [1], SamplingParams(
            stop=[" world", "and"], include_stop_str_in_output=include), tok)
        text = "".join(state.add_tokens([t]) for t in ids)
        assert (text, state.finish_reason) == (want, "stop")
    special = tok.token_to_id("<|im_end|>")
    for skip, want in ((True, "hi"), (False, "hi<|im_end|>")):
        state = RequestState("r", None, [1], SamplingParams(skip_special_tokens=skip), tok)
        ids = tok.encode("hi", add_special_tokens=False) + [special]
        assert state.add_tokens(ids, "length") == want
