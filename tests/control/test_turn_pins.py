"""Turn pins in the job executor: a turn that ended in tool calls is sent
again as a one-token prefill that pins its ids in the host tier; replies to
it are taken and counted, never passed on; with the key off nothing is sent."""

import time

from deepserve.control.je.turn_pins import MAX_PENDING, PREFIX, TurnPins
from deepserve.control.je.turns import MAX_ENDED, TurnBook
from deepserve.messages.engine import RequestDelta, RequestFailed

KEY = ("tenant-a", "smol")


def _ended(book: TurnBook, request_id: str, prompt: list[int], reply: list[int]):
    book.note_prompt(request_id, KEY, "<prompt>", prompt, lambda out: f"<{len(out)} ids>")
    book.on_done(request_id, reply)
    return book.ended(request_id)


def test_a_pinned_turn_is_its_prompt_and_reply_but_the_last_id_held_on_the_host():
    sent, book = [], TurnBook()
    pins = TurnPins(30.0, "ipc://je", lambda msg, ids: sent.append((msg, ids)))
    before = time.time()
    pins.pin(_ended(book, "chat-0", [1, 2, 3], [7, 8, 9]))
    [(msg, ids)] = sent
    assert ids == msg.prompt_token_ids == [1, 2, 3, 7, 8]  # 9: sampled, never computed
    assert msg.request_id.startswith(PREFIX) and (msg.salt, msg.model) == KEY
    assert msg.sampling.max_tokens == 1 and msg.reply_to == "ipc://je"
    pin = msg.pin_context
    assert pin.on_host and pin.context_id == msg.request_id
    assert before + 30.0 <= pin.expires_at <= time.time() + 30.0
    assert book.ended("chat-0") is None  # once


def test_replies_to_a_pin_are_taken_and_counted():
    sent = []
    pins = TurnPins(30.0, "ipc://je", lambda msg, ids: sent.append(msg))
    for i in range(3):
        pins.pin(_ended(TurnBook(), f"chat-{i}", [1, 2], [3, 4]))
    a, b, c = (m.request_id for m in sent)
    assert pins.on_reply(RequestDelta(request_id=a, text="x", token_ids=[5]))  # not the last
    assert pins.on_reply(RequestDelta(request_id=a, text="", token_ids=[], finish_reason="length"))
    assert pins.on_reply(RequestFailed(request_id=b, error="context_over_budget", message="m"))
    assert pins.on_reply(RequestDelta(request_id=c, text="", token_ids=[], finish_reason="abort"))
    assert (pins.num_asked, pins.num_pinned, pins.num_failed) == (3, 1, 2)
    assert not pins.pending
    assert not pins.on_reply(RequestDelta(request_id="ctx-1", text="", token_ids=[]))


def test_nothing_is_sent_when_off_unknown_or_too_short():
    sent, book = [], TurnBook()
    TurnPins(0.0, "ipc://je", lambda *a: sent.append(a)).pin(_ended(book, "r0", [1, 2], [3]))
    pins = TurnPins(30.0, "ipc://je", lambda *a: sent.append(a))
    pins.pin(book.ended("never-done"))
    pins.pin(_ended(book, "r1", [1], []))  # one id: nothing computed to hold
    assert sent == [] and pins.num_asked == 0


def test_pending_pins_and_ended_turns_are_bounded():
    sent, book = [], TurnBook()
    pins = TurnPins(30.0, "ipc://je", lambda msg, ids: sent.append(msg))
    for i in range(MAX_PENDING + 1):
        pins.pin(_ended(book, f"r{i}", [1, 2], [3]))
    assert len(pins.pending) == MAX_PENDING and sent[0].request_id not in pins.pending
    for i in range(MAX_ENDED + 1):
        book.note_prompt(f"e{i}", KEY, "t", [1], lambda out: "")
        book.on_done(f"e{i}", [2])
    assert book.ended("e0") is None and book.ended(f"e{MAX_ENDED}") is not None
