"""Token-id continuity: an agent's next turn reuses the exact ids of the
turn it continues; with no earlier turn the ids are the plain tokenization."""

import pytest

from deepserve.control.je.admission import PromptTokens
from deepserve.control.je.contexts import Context
from deepserve.control.je.turns import MAX_TURNS, TurnBook, prompt_ids
from deepserve.errors import InvalidRequestError
from deepserve.messages.engine import SubmitRequest
from deepserve.messages.sampling import SamplingParams
from deepserve.tokenizer import Tokenizer


@pytest.fixture
def prompts(tiny_model):
    return PromptTokens.for_model(tiny_model, Tokenizer(tiny_model))


def chat(messages, **kw):
    return SubmitRequest(request_id=kw.pop("request_id", "r"), messages=messages,
                         sampling=SamplingParams(), **kw)


TURN1 = [{"role": "user", "content": "def parse(text):\n    return text.split()"}]


def test_no_earlier_turn_gives_the_plain_ids(prompts):
    book = TurnBook()
    text, ids = prompt_ids(prompts, chat(TURN1), book, ("t", "m"), None)
    assert ids == prompts.tokenizer.request_ids(messages=TURN1)[1]
    assert text == prompts.tokenizer.apply_chat_template(TURN1)


def test_the_next_turn_starts_with_the_prompt_and_reply_ids(prompts):
    tok, book, key = prompts.tokenizer, TurnBook(), ("t", "m")
    text, ids = prompt_ids(prompts, chat(TURN1), book, key, None)
    reply = tok.encode("  return [w for w in text.split()]", add_special_tokens=False)
    reply += [tok.token_to_id("<|im_end|>")]  # it stopped on EOS, as a chat turn does
    book.note_prompt("r", key, text, ids, lambda out: tok.decode(out, False))
    assert book.on_done("r", reply) is not None
    turn2 = TURN1 + [{"role": "assistant", "content": tok.decode(reply)},
                     {"role": "user", "content": "now handle tabs"}]
    text2, ids2 = prompt_ids(prompts, chat(turn2, request_id="r2"), book, key, None)
    assert ids2[:len(ids) + len(reply)] == ids + reply  # the KV of turn 1's reply hits
    assert tok.decode(ids2, False) == text2  # and it still spells the prompt
    plain = tok.request_ids(messages=turn2)[1]
    assert tok.decode(plain, False) == text2
    other, ids3 = prompt_ids(prompts, chat(turn2, request_id="r3"), book, ("u", "m"), None)
    assert ids3 == plain  # another tenant's turns are never used


def test_a_reply_the_client_changed_is_not_continued(prompts):
    tok, book, key = prompts.tokenizer, TurnBook(), ("t", "m")
    text, ids = prompt_ids(prompts, chat(TURN1), book, key, None)
    book.note_prompt("r", key, text, ids, lambda out: tok.decode(out, False))
    book.on_done("r", tok.encode("  return 1", add_special_tokens=False))
    turn2 = TURN1 + [{"role": "assistant", "content": "  return 2"},
                     {"role": "user", "content": "ok"}]
    _, ids2 = prompt_ids(prompts, chat(turn2, request_id="r2"), book, key, None)
    assert ids2 == tok.request_ids(messages=turn2)[1]


def test_turns_are_bounded_per_tenant(prompts):
    book, key = TurnBook(), ("t", "m")
    for i in range(MAX_TURNS + 5):
        book.note_prompt(f"r{i}", key, f"text {i}", [i], lambda out: "")
        book.on_done(f"r{i}", [])
    assert len(book._turns[key]) == MAX_TURNS
    assert book.on_done("never-noted", [1]) is None


def test_a_chat_context_comes_first_and_its_ids_are_reused(prompts):
    tok = prompts.tokenizer
    text, guarded = tok.render(TURN1, add_generation_prompt=False)
    ctx = Context("ctx-1", "t", "m", tok.encode_rendered(text, guarded), text, TURN1, 1e12)
    more = [{"role": "user", "content": "and the tests?"}]
    text2, ids2 = prompt_ids(prompts, chat(more), TurnBook(), ("t", "m"), ctx)
    assert ids2[:len(ctx.prompt_token_ids)] == ctx.prompt_token_ids
    assert text2 == tok.apply_chat_template(TURN1 + more)


def test_a_prompt_context_goes_first_in_a_completion_and_not_in_a_chat(prompts):
    ctx = Context("ctx-2", "t", "m", [5, 6, 7], None, None, 1e12)
    msg = SubmitRequest(request_id="c", prompt_token_ids=[8, 9], sampling=SamplingParams())
    assert prompt_ids(prompts, msg, TurnBook(), ("t", "m"), ctx) == (None, [5, 6, 7, 8, 9])
    with pytest.raises(InvalidRequestError, match="completions"):
        prompt_ids(prompts, chat(TURN1), TurnBook(), ("t", "m"), ctx)


def test_a_turn_that_ended_without_a_reply_or_was_dropped_is_forgotten():
    book, key = TurnBook(), ("t", "m")
    for rid in ("failed", "aborted", "ok"):
        book.note_prompt(rid, key, "text", [1, 2], lambda out: "")
    assert book.on_done("failed", None) is None and "failed" not in book._pending
    book.drop("aborted")
    assert "aborted" not in book._pending and book.on_done("aborted", [3]) is None
    assert book.on_done("ok", [3]).ids == [1, 2, 3] and not book._pending
