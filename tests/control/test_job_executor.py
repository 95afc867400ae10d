"""The job executor over real ZeroMQ sockets: a test PUB plays the cluster
manager, test PULL sockets play two TEs and the gateway (je_rig.py)."""

import shutil
import tempfile
import time

import zmq

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.control.je import job_executor
from deepserve.control.je.job_executor import JobExecutor
from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket
from deepserve.messages.control import TEInfo, TEList, TEReport
from deepserve.messages.engine import (AbortRequest, RequestFailed, SubmitRequest, TaskDone,
                                       ToClient)
from deepserve.messages.sampling import SamplingParams
from deepserve.tokenizer import Tokenizer
from tests.control.je_rig import _TE_IN, _publish, _pump, je_settings


def _recv(sock):
    try:
        return sock.get(timeout=0)
    except TimeoutError:
        return None


def _submit(rig, request_id, prompt, salt=None, attempt=0):
    rig["to_je"].put(SubmitRequest(request_id=request_id, prompt=prompt, salt=salt,
                                   sampling=SamplingParams(max_tokens=4), attempt=attempt,
                                   reply_to=rig["addr"]["gw"]))


def test_routes_tokenized_tasks_and_follows_cached_prefixes(rig):
    # the PUB drops messages sent before the JE's SUB connects: repeat until heard
    _pump(rig, lambda: _publish(rig, ["te0", "te1"]) or (rig["je"].te_sockets or None))
    prompt = "def handler(request):\n    return request.headers\n" * 8
    ids = rig["tok"].encode(prompt)
    rig["cm"].put(TEReport(te_id="te1", num_waiting=0, num_running=0, load_tokens=0,
                           kv_usage=0.0, inserted=prompt_block_hashes(ids, 16)))
    _pump(rig, lambda: rig["je"].router.index.num_hashes("te1") or None)
    _submit(rig, "r1", prompt)
    task = _pump(rig, lambda: _recv(rig["te"]["te1"]))
    assert task.request_id == "r1" and task.prompt_token_ids == ids
    assert task.reply_to == rig["addr"]["gw"]
    rig["to_je"].put(AbortRequest(request_id="r1"))
    assert isinstance(_pump(rig, lambda: _recv(rig["te"]["te1"])), AbortRequest)


def test_no_te_and_bad_input_fail_to_the_gateway(rig, monkeypatch):
    monkeypatch.setattr(job_executor, "PARK_S", 0.5)
    _submit(rig, "r2", "hello")
    started = time.monotonic()
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert isinstance(failed, RequestFailed) and failed.error == "engine_dead"
    assert time.monotonic() - started >= 0.5  # parked first: no TE list yet
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    _submit(rig, "r3", "")
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert failed.error == "invalid_request" and failed.param == "prompt"


def test_tasks_of_a_te_that_leaves_fail_retryable_until_attempts_run_out(rig):
    """te_lost: the gateway may resume the request (as attempt 1, 2, ...); at
    the last attempt the error is final (engine_dead), and past it the JE
    refuses the request."""
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    for attempt, error in ((0, "te_lost"), (2, "engine_dead")):
        rig["to_je"].put(SubmitRequest(request_id=f"r{attempt}", prompt="some prompt",
                                       sampling=SamplingParams(max_tokens=4), attempt=attempt,
                                       reply_to=rig["addr"]["gw"]))
        assert _pump(rig, lambda: _recv(rig["te"]["te0"])).attempt == attempt
        _publish(rig, [])
        failed = _pump(rig, lambda: _recv(rig["gw"]))
        assert failed.request_id == f"r{attempt}" and failed.error == error
        assert "te0" not in failed.message  # no topology for tenants
        _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    rig["to_je"].put(SubmitRequest(request_id="r3", prompt="x", attempt=3,
                                   sampling=SamplingParams(max_tokens=4),
                                   reply_to=rig["addr"]["gw"]))
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert failed.error == "engine_dead" and "giving up after 3 attempts" in failed.message


def test_a_task_its_master_finished_fails_if_its_tokenizer_dies_before_the_last_reply(rig):
    """The master's TEReport.finished says the sequence ended, not that its
    tokenizer sent the client the last delta: a tokenizer killed in between
    (a 60-minute chaos run lost a request so) must still fail the task, so
    the gateway resumes it. Only the tokenizer's TaskDone ends it."""
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    for rid in ("done", "cut"):
        _submit(rig, rid, "some prompt")
        assert _pump(rig, lambda: _recv(rig["te"]["te0"])).request_id == rid
    rig["cm"].put(TEReport(te_id="te0", num_waiting=0, num_running=0, load_tokens=0,
                           kv_usage=0.0, finished=["done", "cut"]))
    _pump(rig, lambda: rig["je"].router.reports.get("te0"))
    rig["to_je"].put(TaskDone(request_id="done"))  # its last delta went out
    _pump(rig, lambda: "done" not in rig["je"].tasks or None)
    assert "cut" in rig["je"].tasks
    _publish(rig, [], down={"te0": "tokenizer"})
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.request_id, failed.error) == ("cut", "te_lost")
    assert _recv(rig["gw"]) is None  # "done" ended: nothing to fail


def _tasks_of(rig, te, wait_s=0.3):
    """Every task the TE got within wait_s (the JE keeps stepping)."""
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        rig["je"].step(20)
        while (msg := _recv(rig["te"][te])) is not None:
            got.append(msg)
    return got


def _quarantined(rig):
    return [details for event, details in rig["events"] if event == "request_quarantined"]


def test_a_request_in_flight_at_two_te_crashes_is_quarantined(rig):
    """Poison quarantine: the first crash is te_lost (resumable); the resumed
    suspect goes back to the TE it crashed; the second crash with it fails it
    for good (request_crashed_engine, the request_quarantined event names both
    crashes), and a resubmission of that id is refused at once."""
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    _submit(rig, "p", "the poison prompt")
    assert _pump(rig, lambda: _recv(rig["te"]["te0"])).request_id == "p"
    _publish(rig, ["te1"])  # te0 crashes with p
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.request_id, failed.error) == ("p", "te_lost")
    assert _quarantined(rig) == []
    _publish(rig, ["te0", "te1"])  # te0 is back: a spare for the suspect
    _submit(rig, "p", "the poison prompt", attempt=1)  # the gateway resumes it
    task = _pump(rig, lambda: _recv(rig["te"]["te0"]) or _recv(rig["te"]["te1"]))
    assert (task.request_id, task.attempt) == ("p", 1)
    second = rig["je"].tasks["p"].te_id
    assert second == "te0"  # back where it crashed: te1 and its requests stay untouched
    _publish(rig, ["te1"])  # te0 dies with p again
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.request_id, failed.error) == ("p", "request_crashed_engine")
    assert "te0" not in failed.message and "te1" not in failed.message  # no topology
    assert _quarantined(rig) == [{"request_id": "p", "crashed_tes": ["te0", second],
                                 "crashed_parts": ["", ""], "crashes": 2}]
    _submit(rig, "p", "the poison prompt", attempt=2)  # resubmitted anyway
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.request_id, failed.error) == ("p", "request_crashed_engine")
    assert not _tasks_of(rig, "te0") and not _tasks_of(rig, "te1")


def test_two_crashes_of_different_parts_resume_and_a_third_quarantines(rig):
    """The CM's TE list says which part of a TE failed: a request caught in a
    worker crash and then in a killed tokenizer is resumed again (a request of
    death fails the same part each time); a third crash of any part convicts."""
    rig["je"].isolate_suspects = False
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    for attempt, part, error in ((0, "worker0", "te_lost"), (1, "tokenizer", "te_lost"),
                                 (2, "master", "request_crashed_engine")):
        _submit(rig, "r", "an innocent prompt", attempt=attempt)
        assert _pump(rig, lambda: _recv(rig["te"]["te0"])).attempt == attempt
        _publish(rig, [], down={"te0": part})
        failed = _pump(rig, lambda: _recv(rig["gw"]))
        assert (failed.request_id, failed.error) == ("r", error)
        _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    assert _quarantined(rig) == [{"request_id": "r", "crashed_tes": ["te0"] * 3,
                                 "crashed_parts": ["worker0", "tokenizer", "master"],
                                 "crashes": 3}]


def test_without_isolation_a_suspect_resumes_at_once_and_a_second_crash_quarantines(rig):
    """[router] isolate_suspects = false (the default): the resumed request goes
    to the other TE at once, as before quarantine existed; a second crash with
    it still fails it for good and logs request_quarantined."""
    rig["je"].isolate_suspects = False
    _pump(rig, lambda: _publish(rig, ["te0", "te1"]) or (len(rig["je"].te_sockets) == 2 or None))
    _submit(rig, "p", "the poison prompt")
    first = _pump(rig, lambda: _recv(rig["te"]["te0"]) or _recv(rig["te"]["te1"]))
    crashed = rig["je"].tasks["p"].te_id
    other = "te1" if crashed == "te0" else "te0"
    assert first.request_id == "p"
    _publish(rig, [other])  # the first TE crashes with p
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.request_id, failed.error) == ("p", "te_lost")
    _submit(rig, "p", "the poison prompt", attempt=1)
    task = _pump(rig, lambda: _recv(rig["te"][other]))  # at once: no wait for a spare
    assert (task.request_id, task.attempt) == ("p", 1) and rig["je"].tasks["p"].te_id == other
    _publish(rig, [])  # the second TE dies with it too
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.request_id, failed.error) == ("p", "request_crashed_engine")
    assert _quarantined(rig) == [{"request_id": "p", "crashed_tes": [crashed, other],
                                 "crashed_parts": ["", ""], "crashes": 2}]


def test_suspects_resume_one_at_a_time_with_a_spare_and_are_not_quarantined(rig):
    """Three requests share a crash: each is a suspect, none is quarantined.
    Resumed, they wait while their TE's peer is the only TE left (a poison
    one would take the node down), then run one at a time beside a
    suspect-free TE; one that completes is forgotten."""
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    for rid in "abc":
        _submit(rig, rid, f"prompt {rid}")
    assert [t.request_id for t in _tasks_of(rig, "te0", 1.0)] == ["a", "b", "c"]
    _publish(rig, ["te1"])  # te0 crashes with all three
    failed = [_pump(rig, lambda: _recv(rig["gw"])) for _ in "abc"]
    assert {(f.request_id, f.error) for f in failed} == {(r, "te_lost") for r in "abc"}
    for rid in "abc":
        _submit(rig, rid, f"prompt {rid}", attempt=1)
    assert _tasks_of(rig, "te1", 0.5) == []  # te1 alone: no spare, the suspects wait
    _publish(rig, ["te0", "te1"])
    for rid in "abc":
        tasks = _tasks_of(rig, "te0", 0.5) + _tasks_of(rig, "te1", 0.1)
        assert [(t.request_id, t.attempt) for t in tasks] == [(rid, 1)]  # one at a time
        rig["to_je"].put(TaskDone(request_id=rid, attempt=1))  # its tokenizer: it ended
        _pump(rig, lambda: (rid not in rig["je"].tasks) or None)
    assert _quarantined(rig) == [] and len(rig["je"].suspects) == 0
    assert _recv(rig["gw"]) is None


def test_a_lone_te_takes_a_waiting_suspect_after_the_hold(rig):
    """With one TE there is no spare: the suspect waits hold_s, then runs."""
    rig["je"].isolation.held.hold_s = 0.5
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    _submit(rig, "s", "a suspect")
    _tasks_of(rig, "te0", 0.5)
    _publish(rig, [])
    assert _pump(rig, lambda: _recv(rig["gw"])).error == "te_lost"
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    start = time.monotonic()
    _submit(rig, "s", "a suspect", attempt=1)
    task = _pump(rig, lambda: _recv(rig["te"]["te0"]))
    assert task.request_id == "s" and time.monotonic() - start >= 0.45


def test_pd_aware_routing_follows_the_heatmap(tiny_model):
    """Algorithm 1: a long prompt with a short output goes to the prefill/decode
    pair (the decode TE gets it with prefill_from = the prefill TE's inbox), a
    short prompt with a long output to the colocated TE; when the prefill TE
    leaves, the job's request fails and its decode task is aborted."""
    from deepserve.control.je.routing.decode_predictor import DecodeLengthPredictor
    from deepserve.control.je.routing.pd_heatmap import Heatmap
    from deepserve.control.je.routing.pd_policy import PDPolicy
    tok = Tokenizer(tiny_model)
    long_prompt = "def handler(request):\n    return request.headers\n" * 60
    short_prompt = "Tell me a story"
    pairs = [(tok.encode(long_prompt + str(i)), 20) for i in range(20)]
    pairs += [(tok.encode(short_prompt + " " * i), 700) for i in range(20)]
    predictor = DecodeLengthPredictor.train(pairs, num_buckets=8, epochs=100)
    heatmap = Heatmap(prompt_len_edges=[0, 256, 100000], ratio_edges=[0, 0.5, 1000],
                      values=[[-0.2, -0.3], [0.5, -0.1]])
    d = tempfile.mkdtemp(prefix="dspd")
    ctx = zmq.Context()
    addr = {n: f"ipc://{d}/{n}.sock" for n in ("je", "cm", "gw", "c0", "p0", "d0")}
    cm = PubSocket(ctx, addr["cm"], bind=True)
    je = JobExecutor(ctx, je_settings(addr["je"], addr["cm"], tiny_model),
                     pd_policy=PDPolicy("heatmap", heatmap, predictor))
    tes = {t: PullSocket(ctx, addr[t], bind=True, type=_TE_IN) for t in ("c0", "p0", "d0")}
    rig = {"je": je, "to_je": PushSocket(ctx, addr["je"], bind=False), "addr": addr,
           "gw": PullSocket(ctx, addr["gw"], bind=True, type=ToClient)}
    types = {"c0": "colocated", "p0": "prefill", "d0": "decode"}

    def publish(names):
        cm.put(TEList(tes=[TEInfo(te_id=t, te_type=types[t], model="m", address=addr[t])
                           for t in names]))
    try:
        _pump(rig, lambda: publish(types) or (len(je.te_sockets) == 3 or None))
        _submit(rig, "long", long_prompt)
        task = _pump(rig, lambda: _recv(tes["d0"]))
        assert task.request_id == "long" and task.prefill_from == addr["p0"]
        _submit(rig, "short", short_prompt)
        task = _pump(rig, lambda: _recv(tes["c0"]))
        assert task.request_id == "short" and task.prefill_from is None
        publish(["c0", "d0"])  # the prefill TE leaves while "long" runs
        failed = _pump(rig, lambda: _recv(rig["gw"]))
        assert failed.request_id == "long" and failed.error == "te_lost"  # resumable
        abort = _pump(rig, lambda: _recv(tes["d0"]))
        assert isinstance(abort, AbortRequest) and abort.request_id == "long"
        # With no prefill TE left, the long prompt goes to the colocated TE.
        _submit(rig, "long2", long_prompt)
        assert _pump(rig, lambda: _recv(tes["c0"])).request_id == "long2"
    finally:
        je.close()
        for sock in [cm, rig["to_je"], rig["gw"], *tes.values()]:
            sock.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


def test_a_request_before_the_first_te_list_waits_for_it(rig):
    """A JE that just (re)started has no TE list: the request is parked, not
    refused, and routed as soon as the list arrives (issue 11)."""
    _submit(rig, "early", "hello")
    _pump(rig, lambda: rig["je"].parking or None)
    assert _recv(rig["gw"]) is None
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    task = _pump(rig, lambda: _recv(rig["te"]["te0"]))
    assert task.request_id == "early" and not rig["je"].parking
    assert _recv(rig["gw"]) is None  # no failure was sent


def test_a_te_that_just_failed_is_fenced(rig):
    """A dying TE can flap back into the TE list (its host's last TEUp after
    the supervisor's TEDown): the JE routes nothing to it for fence_s, so a
    resumed request goes elsewhere and te0 leaving again is no second crash.
    Fails without the fence: p went back to te0 and was quarantined with it."""
    je = rig["je"]
    je.isolate_suspects, je.links.fence_s = False, 3.0
    _pump(rig, lambda: _publish(rig, ["te0"]) or (je.te_sockets or None))
    _submit(rig, "p", "an innocent prompt")
    assert _pump(rig, lambda: _recv(rig["te"]["te0"])).request_id == "p"
    _publish(rig, ["te1"])  # te0 crashes with p
    assert _pump(rig, lambda: _recv(rig["gw"])).error == "te_lost"
    _publish(rig, ["te0", "te1"])  # te0's stale TEUp put it back in the CM's list
    _pump(rig, lambda: ("te1" in je.te_sockets) or None)
    _submit(rig, "p", "an innocent prompt", attempt=1)
    task = _pump(rig, lambda: _recv(rig["te"]["te1"]) or _recv(rig["te"]["te0"]))
    assert (task.request_id, task.attempt, je.tasks["p"].te_id) == ("p", 1, "te1")
    assert "te0" not in je.te_sockets
    _publish(rig, ["te1"])  # te0's host noticed its dead worker: TEDown again
    assert _tasks_of(rig, "te1", 0.3) == [] and _recv(rig["gw"]) is None
    assert _quarantined(rig) == [] and je.suspects.crashes("p") == ["te0"]


def test_an_incomplete_te_list_changes_nothing(rig):
    """A CM incarnation that has not heard from its TEs says is_complete =
    False: its (empty) list must not fail the tasks of the TEs it misses."""
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    _submit(rig, "q", "a prompt")
    assert _pump(rig, lambda: _recv(rig["te"]["te0"])).request_id == "q"
    rig["cm"].put(TEList(tes=[], cm_incarnation="new", is_complete=False))
    assert _tasks_of(rig, "te0", 0.3) == [] and _recv(rig["gw"]) is None
    assert "q" in rig["je"].tasks and "te0" in rig["je"].te_sockets


def test_a_te_that_does_not_take_the_task_fails_it_retryable_without_blocking(rig):
    """The TE's inbox does not take the task (its queue is full: a stuck
    tokenizer): the put gives up after the send timeout and the request fails
    te_lost (the gateway resumes it); the next put to that TE does not wait."""
    je = rig["je"]

    class Stuck:  # a PUSH socket at its high-water mark
        waits = []

        def put(self, msg, timeout=None):
            self.waits.append(timeout)
            time.sleep(timeout)
            raise TimeoutError

        def close(self):
            pass

    _pump(rig, lambda: _publish(rig, ["te0"]) or (je.te_sockets or None))
    je.links.outboxes._sockets[rig["addr"]["te0"]] = Stuck()
    for request_id in ("g1", "g2"):
        _submit(rig, request_id, "a prompt")
        failed = _pump(rig, lambda: _recv(rig["gw"]))
        assert (failed.request_id, failed.error) == (request_id, "te_lost")
        assert request_id not in je.tasks
    assert Stuck.waits == [je.links.outboxes.timeout_s, 0.0]


def test_n_sub_requests_tokenize_once_and_an_oversized_prompt_not_at_all(rig):
    """The gateway's n sub-requests ({id}-{i}) share one tokenization; a prompt
    whose characters cannot fit max_model_len tokens fails at once (400,
    naming the field) without being tokenized."""
    je = rig["je"]
    _pump(rig, lambda: _publish(rig, ["te0"]) or (je.te_sockets or None))
    prompt = "The same long prompt for every choice. " * 20
    for i in range(4):
        _submit(rig, f"cmpl-1-{i}", prompt)
    tasks = _tasks_of(rig, "te0", 0.5)
    assert [t.request_id for t in tasks] == [f"cmpl-1-{i}" for i in range(4)]
    assert len({tuple(t.prompt_token_ids) for t in tasks}) == 1
    assert je.book.prompts(je.book.default).num_tokenized == 1
    huge = "x" * (je.book.prompts(je.book.default).max_chars + 1)
    _submit(rig, "huge", huge)
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.error, failed.param) == ("prompt_too_long", "prompt")
    rig["to_je"].put(SubmitRequest(request_id="huge-chat", sampling=SamplingParams(max_tokens=4),
                                   messages=[{"role": "user", "content": huge}],
                                   reply_to=rig["addr"]["gw"]))
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert (failed.error, failed.param) == ("prompt_too_long", "messages")
    assert je.book.prompts(je.book.default).num_tokenized == 1


def _pending_chat(rig, request_id):
    rig["to_je"].put(SubmitRequest(request_id=request_id, messages=[
        {"role": "user", "content": "hello"}], sampling=SamplingParams(max_tokens=4),
        reply_to=rig["addr"]["gw"]))
    _pump(rig, lambda: request_id in rig["je"].turns._pending or None)


def test_a_chat_that_fails_or_is_aborted_leaves_no_pending_turn(rig):
    """Its prompt waited for a TurnDone that never came, until MAX_PENDING
    others pushed it out: a failed request's TurnDone has no reply ids, an
    aborted one's AbortRequest drops it."""
    from deepserve.messages.contexts import TurnDone
    _pump(rig, lambda: _publish(rig, ["te0"]) or (rig["je"].te_sockets or None))
    _pending_chat(rig, "c1")
    rig["to_je"].put(TurnDone(request_id="c1", output_ids=None))  # it failed
    _pump(rig, lambda: ("c1" not in rig["je"].turns._pending) or None)
    _pending_chat(rig, "c2")
    rig["to_je"].put(AbortRequest(request_id="c2"))  # its client left
    _pump(rig, lambda: ("c2" not in rig["je"].turns._pending) or None)
    _pending_chat(rig, "c3")
    rig["to_je"].put(TurnDone(request_id="c3", output_ids=[5, 6]))  # it completed: a turn
    _pump(rig, lambda: rig["je"].turns.ended("c3"))
    assert not rig["je"].turns._pending
