"""A job executor restart, and a lost TE, seen from the gateway (issue 11).

The fake backend closes its JE inbox (what was queued there dies with it) and
binds a new one, while its "TEs" keep streaming. Nothing hangs, nothing is
refused, `can_route` tells the truth meanwhile; a resumed stream's text
equals an uninterrupted one's."""

from __future__ import annotations

import json
import random
import threading

from tests.gateway.fake_backend import TOKEN_BASE, WORDS

MODEL = "tiny-test"


def _complete(stack, prompt: str, results: dict, key: str, **extra) -> threading.Thread:
    def run():
        with stack.http(timeout=15.0) as http:
            results[key] = http.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 6, "seed": 7, **extra})
    thread = threading.Thread(target=run, name=f"client-{key}")
    thread.start()
    return thread


def _client(stack):
    return stack.server.config.app.state.gateway.client


def test_a_submission_lost_in_a_dead_je_is_resumed_by_the_next(make_stack):
    """Fails on a gateway that does not follow its JE: the request waits for its deadline."""
    stack = make_stack(request_timeout_s=8.0)
    backend, results = stack.backend, {}
    backend.hold_submits = True  # the JE takes the request and dies before routing it
    thread = _complete(stack, "lost in the JE", results, "lost")
    assert backend.wait_for(lambda: backend.submits)
    [first] = list(backend.submits)
    backend.hold_submits = False
    backend.restart_je()
    thread.join(15.0)
    response = results["lost"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    resumed = [s for s in backend.submits if s.request_id != first.request_id]
    assert [s.request_id for s in resumed] == [f"{first.request_id}.je1"]
    assert resumed[0].attempt == 1 and resumed[0].prompt == first.prompt
    assert resumed[0].resumed_output_ids == 0 and resumed[0].resumed_text_chars == 0


def _stream_text(http, prompt: str, seed: int, max_tokens: int, on_chunk=None, **extra) -> str:
    """The streamed text of one completion; on_chunk(i) after the i-th text chunk."""
    text, num_chunks = [], 0
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "seed": seed,
            "stream": True, **extra}) as response:
        assert response.status_code == 200
        lines = []
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            assert '"error"' not in line, line
            if line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("text"):
                    text.append(choice["text"])
                    num_chunks += 1
                    if on_chunk is not None:
                        on_chunk(num_chunks)
    assert lines[-1] == "data: [DONE]"
    return "".join(text)


def test_a_running_stream_is_resumed_from_its_tokens_after_a_je_restart(make_stack):
    """The new JE must learn the task: the gateway resubmits it as attempt 1
    with prompt + streamed tokens; the old attempt's deltas are dropped and
    the old attempt is aborted at its TE."""
    stack = make_stack(request_timeout_s=10.0)
    backend = stack.backend
    with stack.http(timeout=15.0) as http:
        whole = _stream_text(http, "stream on", 3, 16)
        backend.delay_s = 0.15
        backend.submits.clear()
        text = _stream_text(http, "stream on", 3, 16,
                            on_chunk=lambda i: i == 3 and backend.restart_je())
    assert text == whole
    first = backend.submits[0]
    resumed = [s for s in backend.submits if s.request_id == f"{first.request_id}.je1"]
    assert len(resumed) == 1 and resumed[0].attempt == 1
    streamed = resumed[0].prompt_token_ids[len(b"stream on"):]
    assert len(streamed) >= 3 and all(t >= TOKEN_BASE for t in streamed)
    assert resumed[0].resumed_output_ids == len(streamed)
    assert resumed[0].sampling.max_tokens == 16 - len(streamed)
    # the orphaned old attempt was aborted by its old wire id (at its TE and the new JE)
    assert backend.wait_for(lambda: first.request_id in backend.aborts)


def test_requests_sent_while_the_je_is_down_wait_for_the_next_one(make_stack):
    stack = make_stack(request_timeout_s=8.0)
    backend, results, client = stack.backend, {}, _client(stack)
    assert client.can_route
    restarter = threading.Thread(target=backend.restart_je, kwargs={"down_s": 1.0},
                                 name="je-restart")
    restarter.start()
    assert backend.wait_for(lambda: not client.can_route, 3.0)
    assert client.te_ids  # the CM still lists the TE: only the JE is missing
    thread = _complete(stack, "sent while the JE is down", results, "during")
    restarter.join(5.0)
    thread.join(15.0)
    assert results["during"].status_code == 200, results["during"].text
    assert backend.wait_for(lambda: client.can_route, 3.0)
    during = [s for s in backend.submits if s.prompt == "sent while the JE is down"]
    assert len(during) == 1 and during[0].attempt == 0  # sent once: waited in the pipe


def _seed_ending_third_word_in(letter: str) -> int:
    for seed in range(1000):
        rng = random.Random(seed)
        words = [WORDS[rng.randrange(len(WORDS))] for _ in range(3)]
        if words[2].endswith(letter):
            return seed
    raise AssertionError("no such seed")


def test_a_resumed_stream_has_the_text_an_uninterrupted_one_has(stack):
    """The TE is lost after 3 tokens while it holds back the last character
    (the start of a stop string): the resumed attempt is told the tokens and
    the characters the caller has, so nothing is missing or doubled. Fails
    when resumed_text_chars is not passed on (the text is repeated)."""
    seed = _seed_ending_third_word_in("a")
    backend = stack.backend
    with stack.http(timeout=10.0) as http:
        whole = _stream_text(http, "[lose3]x", seed, 8, stop=["a!"])
    lost = [s for s in backend.submits if s.prompt == "[lose3]x"][-1]
    resumed = [s for s in backend.submits if s.request_id == lost.request_id and s.attempt == 1]
    assert len(resumed) == 1
    num_tokens, num_chars = backend.lost[lost.request_id]
    assert (resumed[0].resumed_output_ids, resumed[0].resumed_text_chars) == (3, num_chars)
    held_back = " ".join(WORDS[t - TOKEN_BASE] for t in resumed[0].prompt_token_ids[-3:])
    assert num_chars == len(held_back) - 1  # the final "a" was held back when it was lost
    with stack.http(timeout=10.0) as http:
        assert whole == _stream_text(http, "not lost", seed, 8, stop=["a!"])


def test_a_resumed_stream_without_max_tokens_leaves_it_to_the_te():
    """max_tokens unset: the resumed attempt keeps it unset (the TE counts
    resumed_output_ids against the model's max_new_tokens); the caller gets
    as many tokens as an uninterrupted request."""
    from tests.gateway.conftest import running_stack
    with running_stack() as stack, stack.http(timeout=10.0) as http:
        whole = _stream_text(http, "[lose3]y", 11, None)
        lost = [s for s in stack.backend.submits if s.prompt == "[lose3]y"][-1]
        [resumed] = [s for s in stack.backend.submits
                     if s.request_id == lost.request_id and s.attempt == 1]
        assert resumed.resumed_output_ids == 3 and resumed.sampling.max_tokens is None
        assert whole == _stream_text(http, "not lost", 11, None)
    assert len(whole.split()) == stack.backend.model_max_tokens


def test_je_link_epochs_follow_connects_and_disconnects():
    import zmq

    from deepserve.gateway.link.je_link import JELink

    calls: list[int] = []
    link = JELink(calls.append)
    link.on_event(zmq.EVENT_CONNECTED)  # the first JE: nothing to resume
    assert (link.epoch, link.is_connected, calls) == (0, True, [0])
    link.on_event(zmq.EVENT_DISCONNECTED)
    link.on_event(zmq.EVENT_DISCONNECTED)  # a repeat ends no second incarnation
    assert (link.epoch, link.is_connected) == (1, False)
    link.on_event(zmq.EVENT_CONNECTED)
    assert (link.epoch, link.is_connected, calls) == (1, True, [0, 1])


def test_a_context_call_a_dead_je_took_is_answered_not_left_hanging(make_stack):
    """Fails on a gateway that does not answer it: POST /v1/contexts waits for
    request_timeout_s (504) although the JE that had it is gone."""
    stack = make_stack(request_timeout_s=60.0)
    backend, results = stack.backend, {}

    def create():
        with stack.http(timeout=20.0) as http:
            results["ctx"] = http.post("/v1/contexts", json={
                "model": MODEL, "prompt": "a long shared prefix", "ttl_s": 60})
    thread = threading.Thread(target=create)
    thread.start()
    assert backend.wait_for(lambda: backend.context_calls)
    backend.restart_je()
    thread.join(20.0)
    response = results["ctx"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_dead"


def test_with_a_standby_head_requests_follow_the_je_to_the_other_head(make_stack):
    """The gateway's PUSH connects to both heads' JEs (ZMQ_IMMEDIATE): the JE
    moves from the first to the second (the head died, the standby took over).
    A stream in flight resumes at the new JE from its tokens, as after a JE
    restart; a request sent while no JE is anywhere is not refused (nothing can
    wait in a pipe: it waits in its route) and reaches the new JE once, as it
    was. Fails without the waiting: 503, or a request that never arrives."""
    stack = make_stack(request_timeout_s=10.0, standby=True)
    backend, results, client = stack.backend, {}, _client(stack)
    standby = stack.config.je_address.split(",")[1]
    with stack.http(timeout=15.0) as http:
        whole = _stream_text(http, "stream on", 3, 16)
        backend.delay_s = 0.15
        backend.submits.clear()
        mover = threading.Thread(target=backend.move_je, args=(standby, 1.0), name="je-move")

        def on_chunk(i: int) -> None:
            if i == 3:
                mover.start()
                assert backend.wait_for(lambda: not client.can_route, 3.0)
                results["thread"] = _complete(stack, "sent with no JE anywhere", results, "during")
        text = _stream_text(http, "stream on", 3, 16, on_chunk=on_chunk)
    mover.join(5.0)
    results["thread"].join(15.0)
    assert text == whole
    assert backend.je_address == standby
    first = backend.submits[0]
    resumed = [s for s in backend.submits if s.request_id == f"{first.request_id}.je1"]
    assert len(resumed) == 1 and resumed[0].attempt == 1 and resumed[0].resumed_output_ids >= 3
    assert results["during"].status_code == 200, results["during"].text
    during = [s for s in backend.submits if s.prompt == "sent with no JE anywhere"]
    assert len(during) == 1 and during[0].attempt == 0 and "." not in during[0].request_id


def test_a_resumed_attempt_shrinks_min_tokens_and_asks_no_prompt_logprobs_again():
    from tests.gateway.conftest import running_stack
    with running_stack() as stack, stack.http(timeout=10.0) as http:
        _stream_text(http, "[lose3]z", 5, 10, min_tokens=8, prompt_logprobs=1)
        lost = [s for s in stack.backend.submits if s.prompt == "[lose3]z"][-1]
        [resumed] = [s for s in stack.backend.submits
                     if s.request_id == lost.request_id and s.attempt == 1]
    assert (lost.sampling.min_tokens, lost.sampling.prompt_logprobs) == (8, 1)
    assert resumed.resumed_output_ids == 3
    assert (resumed.sampling.min_tokens, resumed.sampling.prompt_logprobs) == (5, None)
    assert resumed.sampling.max_tokens == 7
