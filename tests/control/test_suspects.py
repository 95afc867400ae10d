"""SuspectBook: crashes per request id, quarantine at the second of one part, bounded memory."""

import pytest

from deepserve.control.je.suspects import SuspectBook


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_one_crash_is_a_suspect_two_are_quarantine_and_completion_forgets():
    clock = Clock()
    book = SuspectBook(clock=clock)
    assert not book.is_suspect("r") and not book.is_quarantined("r")
    assert book.crashed("r", "te0") == ["te0"]
    assert book.is_suspect("r") and not book.is_quarantined("r")
    clock.t = 20.0
    assert book.crashed("r", "te0") == ["te0", "te0"]  # the same TE, restarted, counts
    assert book.is_quarantined("r") and not book.is_suspect("r")
    book.crashed("s", "te1")
    book.forget("s")
    assert book.crashes("s") == [] and len(book) == 1


def test_crashes_of_different_parts_do_not_convict_a_third_of_any_does():
    # seen in a chaos run with overlapping faults: a request resumed after a
    # poison request's worker crash was in flight when a drill killed the
    # tokenizer; it was quarantined though it had caused neither
    book = SuspectBook(clock=Clock())
    book.crashed("r", "te0", "worker0")
    assert book.crashed("r", "te0", "tokenizer") == ["te0", "te0"]
    assert book.is_suspect("r") and not book.is_quarantined("r")
    assert book.parts("r") == ["worker0", "tokenizer"]
    book.crashed("r", "te1", "master")  # a third crash, whatever its part
    assert book.is_quarantined("r") and not book.is_suspect("r")
    book.crashed("p", "te0", "worker0")  # a request of death: the same part twice
    book.crashed("p", "te0", "worker0")
    assert book.is_quarantined("p")
    book.crashed("u", "te0", "worker0")  # a part not known (a CM restarted between)
    book.crashed("u", "te0", "")         # counts as any part: as before parts were told
    assert book.is_quarantined("u")


def test_memory_is_bounded_by_age_and_count():
    clock = Clock()
    book = SuspectBook(ttl_s=10.0, capacity=2, clock=clock)
    book.crashed("a", "te0")
    clock.t = 5.0
    book.crashed("b", "te0")
    book.crashed("c", "te0")  # over capacity: "a" (oldest last crash) goes
    assert book.crashes("a") == [] and book.crashes("b") == ["te0"]
    clock.t = 15.5  # "b" and "c" crashed at 5.0: 10.5 s ago
    assert len(book) == 0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        SuspectBook(capacity=0)


def test_held_suspects_wait_longer_for_a_spare_that_once_existed():
    from deepserve.control.je.suspects import SPARE_WAIT_S, HeldSuspects
    from types import SimpleNamespace
    clock = Clock()
    held = HeldSuspects(hold_s=15.0, max_held=2, max_wait_s=300.0, clock=clock)
    colocated = lambda ids: "colocated"  # noqa: E731
    held.add(SimpleNamespace(request_id="a"), [1])
    clock.t = 16.0  # a lone TE: no spare ever listed, the suspect may run solo
    assert [(h.msg.request_id, e, s) for h, e, s in held.due(colocated)] == [("a", False, False)]
    held.note_listed(["colocated", "colocated", "prefill", "decode"])
    assert [s for _, _, s in held.due(colocated)] == [True]  # one is restarting: wait
    clock.t = SPARE_WAIT_S + 1
    assert [s for _, _, s in held.due(colocated)] == [False]
    clock.t = 301.0
    assert [e for _, e, _ in held.due(colocated)] == [True]  # the JE fails it
    held.add(SimpleNamespace(request_id="b"), [2])
    pushed_out = held.add(SimpleNamespace(request_id="c"), [3])
    assert pushed_out.msg.request_id == "a" and len(held) == 2
    held.drop("b")
    assert [h.msg.request_id for h, _, _ in held.due(colocated)] == ["c"]
