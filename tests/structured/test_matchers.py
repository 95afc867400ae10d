"""GrammarBook on a real vocabulary (the tiny model's byte-level BPE):
decoding under its mask yields text the grammar accepts, a batch mixes
grammar and free rows, replayed output continues a grammar, and an ended
grammar allows only EOS."""

from __future__ import annotations

import json
import re

import torch

from deepserve.messages.sampling import StructuredOutput
from deepserve.structured.matchers import GrammarBook
from deepserve.tokenizer import Tokenizer

VOCAB = 2048
EOS = 0
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}},
          "required": ["city", "n"]}


def _decode(book: GrammarBook, seq_ids: list[int], steps: int, seed: int = 0
            ) -> dict[int, list[int]]:
    """Sample every row from random logits under the book's masks."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[int, list[int]] = {s: [] for s in seq_ids}
    live = list(seq_ids)
    for _ in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=gen) * 3
        book.mask(live, logits)
        tokens = logits.argmax(dim=-1).tolist()
        assert book.accept(live, tokens) == []
        for s, t in zip(live, tokens):
            out[s].append(t)
        live = [s for s, t in zip(live, tokens) if t != EOS]
    return out


def test_json_schema_and_regex_rows_beside_a_free_row(tiny_model):
    tok = Tokenizer(tiny_model)
    book = GrammarBook(tiny_model, VOCAB, [EOS])
    book.add(1, StructuredOutput(kind="json", spec=json.dumps(SCHEMA), compact=True), [])
    book.add(2, StructuredOutput(kind="regex", spec=r"[a-c]{2,4}!"), [])
    out = _decode(book, [1, 2, 3], 200)
    assert out[1][-1] == EOS and out[2][-1] == EOS
    value = json.loads(tok.decode(out[1][:-1]))
    assert set(value) == {"city", "n"} and isinstance(value["n"], int)
    assert re.fullmatch(r"[a-c]{2,4}!", tok.decode(out[2][:-1]))
    assert len(out[3]) == 200  # the free row was never masked to EOS


def test_replayed_output_continues_the_grammar(tiny_model):
    """A sequence that arrives with output (a resumed attempt) goes on from
    there: the whole text, replay and new tokens, follows the grammar."""
    tok = Tokenizer(tiny_model)
    spec = StructuredOutput(kind="choice", spec=json.dumps(["alphabet soup", "alpha"]))
    first = GrammarBook(tiny_model, VOCAB, [EOS])
    first.add(1, spec, [])
    whole = _decode(first, [1], 50, seed=1)[1]
    assert tok.decode(whole[:-1]) in ("alphabet soup", "alpha")
    prefix = tok.encode("alphabet", add_special_tokens=False)
    second = GrammarBook(tiny_model, VOCAB, [EOS])
    second.add(7, spec, prefix)
    rest = _decode(second, [7], 50, seed=2)[7]
    assert tok.decode(prefix + rest[:-1]) == "alphabet soup"


def test_an_ended_grammar_allows_only_eos_from_then_on(tiny_model):
    book = GrammarBook(tiny_model, VOCAB, [EOS])
    book.add(1, StructuredOutput(kind="choice", spec=json.dumps(["ok"])), [])
    tok = Tokenizer(tiny_model)
    ids = tok.encode("ok", add_special_tokens=False)
    book.mask([1], torch.zeros(1, VOCAB))
    assert book.accept([1] * len(ids[:1]), ids[:1]) == []
    for t in ids[1:]:
        book.mask([1], torch.zeros(1, VOCAB))
        assert book.accept([1], [t]) == []
    logits = book.mask([1], torch.zeros(1, VOCAB))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert book.accept([1], [EOS]) == []
    after = book.mask([1], torch.zeros(1, VOCAB))  # a step in flight: EOS again
    assert torch.isfinite(after[0]).nonzero().flatten().tolist() == [EOS]
    assert book.accept([1], [EOS]) == []  # an ended grammar takes nothing more


def test_a_refused_token_is_reported_and_drop_forgets(tiny_model):
    book = GrammarBook(tiny_model, VOCAB, [EOS])
    book.add(1, StructuredOutput(kind="regex", spec="a+"), [])
    book.mask([1], torch.zeros(1, VOCAB))
    bad = Tokenizer(tiny_model).encode("z", add_special_tokens=False)[0]
    assert book.accept([1], [bad]) == [1]
    book.drop(1)
    assert 1 not in book
    assert bool(torch.isfinite(book.mask([1], torch.zeros(1, VOCAB))).all())
