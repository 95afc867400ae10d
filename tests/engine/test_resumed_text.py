"""A resumed stream's text equals an uninterrupted one's: a request stopped
after k tokens and resumed with resumed_output_ids = k and
resumed_text_chars = what its caller received produces exactly the rest,
whether k splits a multi-byte UTF-8 character or a stop string's prefix was
held back (and a stop string still matches across the boundary)."""

from __future__ import annotations

import pytest

from deepserve.engine.output_processor import RequestState
from deepserve.messages.engine import AddRequest, NewTokens, RequestDelta, StepTokens, SubmitRequest
from deepserve.messages.sampling import SamplingParams
from deepserve.tokenizer import Tokenizer
from tests.engine.actor_harness import TokenizerHarness, drain

TEXT = "naïve café → 世界 🙂 done, and more"
STOPS = {"none": [], "across": ["café → 世"], "emoji": ["🙂 d"]}


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def _feed(state: RequestState, ids: list[int], last: bool) -> str:
    """Feed ids one at a time (the last with finish "length" if `last`)."""
    text = ""
    for i, t in enumerate(ids):
        if state.is_finished:
            break
        text += state.add_tokens([t], "length" if last and i == len(ids) - 1 else None)
    return text


def _resumed(tok, prompt, out, sampling, k) -> tuple[str, str]:
    first = RequestState("r", None, prompt, sampling, tok)
    text_a = _feed(first, out[:k], last=False)
    second = RequestState("r", None, prompt + out[:k], sampling, tok,
                          resumed_output_ids=k, resumed_text_chars=len(text_a))
    return text_a, _feed(second, out[k:], last=True)


@pytest.mark.parametrize("stop", list(STOPS), ids=list(STOPS))
def test_every_cut_point_gives_the_uninterrupted_text(tok, stop):
    prompt, out = tok.encode("print("), tok.encode(TEXT)
    sampling = SamplingParams(max_tokens=100, stop=STOPS[stop])
    whole = _feed(RequestState("r", None, prompt, sampling, tok), out, last=True)
    assert whole == (TEXT[:TEXT.find(STOPS[stop][0])] if STOPS[stop] else TEXT)
    splits = held = 0
    for k in range(1, len(out)):
        text_a, text_b = _resumed(tok, prompt, out, sampling, k)
        assert text_a + text_b == whole, k
        complete = tok.decode(out[:k])
        splits += complete.endswith("\ufffd")
        held += len(text_a) < len(complete.rstrip("\ufffd")) and len(text_a) < len(whole)
    assert splits > 0  # some k cut a multi-byte character
    assert held > 0 or not STOPS[stop]  # some k held a stop string's prefix back


def test_bogus_resume_fields_never_crash(tok):
    prompt, out = tok.encode("x"), tok.encode("abc")
    for k, chars in [(10 ** 6, 10 ** 6), (-5, -5), (len(prompt), 0)]:
        state = RequestState("r", None, prompt, SamplingParams(), tok,
                             resumed_output_ids=k, resumed_text_chars=chars)
        assert "\ufffd" not in _feed(state, out, last=True)


def _through_actor(h: TokenizerHarness, submit: SubmitRequest, out: list[int]) -> str:
    h.send(submit)
    assert isinstance(drain(h.master, 0.2)[-1], AddRequest)
    for i, t in enumerate(out):
        h.send(StepTokens(items=[NewTokens(submit.request_id, [t],
                                           "length" if i == len(out) - 1 else None)]))
    deltas = [d for d in drain(h.client, 0.2) if isinstance(d, RequestDelta)]
    assert deltas[-1].finish_reason is not None
    return "".join(d.text for d in deltas)


def test_tokenizer_actor_resumes_text_from_the_ids(tiny_model, short_dir, tok):
    h = TokenizerHarness(str(tiny_model), short_dir)
    try:
        prompt, out = tok.encode("print("), tok.encode(TEXT)
        sampling = SamplingParams(max_tokens=100, stop=STOPS["across"])
        whole = TEXT[:TEXT.find(STOPS["across"][0])]
        for k in (3, 11, 13):  # inside "ï", inside "→", after the stop's prefix "café →"
            text_a = _resumed(tok, prompt, out, sampling, k)[0]
            text_b = _through_actor(h, SubmitRequest(
                request_id=f"r{k}", prompt_token_ids=prompt + out[:k], sampling=sampling,
                attempt=1, resumed_output_ids=k, resumed_text_chars=len(text_a)), out[k:])
            assert text_a + text_b == whole, k
    finally:
        h.close()
