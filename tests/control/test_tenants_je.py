"""The job executor's tenants over real sockets (je_rig.py): TEs with one
slot each, a fair queue, limits, and a TE that dies while requests wait."""

import time

import msgspec

from deepserve.config.tenants import TenantsSection
from deepserve.control.je import job_executor
from deepserve.control.je.fair_share import FairShare
from deepserve.messages.control import TEInfo, TEList, TEReport
from deepserve.messages.engine import RequestFailed, SubmitRequest, TaskDone
from deepserve.messages.sampling import SamplingParams
from tests.control.je_rig import _pump


def _recv(sock):
    try:
        return sock.get(timeout=0)
    except TimeoutError:
        return None


def _publish(rig, tes, slots=1):
    rig["cm"].put(TEList(tes=[TEInfo(te_id=t, model="m", address=rig["addr"][t],
                                     max_num_seqs=slots) for t in tes]))


def _listed(rig, tes):
    _pump(rig, lambda: _publish(rig, tes) or (set(rig["je"].te_sockets) == set(tes) or None))


def _submit(rig, request_id, tenant, attempt=0):
    rig["to_je"].put(SubmitRequest(request_id=request_id, prompt="same length prompt",
                                   tenant=tenant, salt=tenant, attempt=attempt,
                                   sampling=SamplingParams(max_tokens=4),
                                   reply_to=rig["addr"]["gw"]))


def _queued(rig, n):
    _pump(rig, lambda: sum(len(q) for q in rig["je"].share.queues.values()) == n or None)


def test_a_full_te_gets_no_more_and_its_queue_goes_out_in_fair_order(rig):
    _listed(rig, ["te0"])
    _submit(rig, "a1", "a")
    first = _pump(rig, lambda: _recv(rig["te"]["te0"]))
    assert first.request_id == "a1" and first.tenant == "a"
    assert first.done_to == rig["addr"]["je"]
    for rid, tenant in [("a2", "a"), ("a3", "a"), ("b1", "b")]:
        _submit(rig, rid, tenant)
    _queued(rig, 3)
    assert _recv(rig["te"]["te0"]) is None  # one slot, taken
    order = []
    for done in ["a1", "a2", "b1"]:
        rig["to_je"].put(TaskDone(request_id=done))
        order.append(_pump(rig, lambda: _recv(rig["te"]["te0"])).request_id)
    assert order == ["a2", "b1", "a3"]  # b1 ahead of a3: a is past its share
    _queued(rig, 0)


def test_a_late_task_done_of_an_earlier_attempt_frees_nothing(rig):
    _listed(rig, ["te0"])
    _submit(rig, "r1", "a", attempt=1)
    _pump(rig, lambda: _recv(rig["te"]["te0"]))
    _submit(rig, "r2", "a")
    _queued(rig, 1)
    rig["to_je"].put(TaskDone(request_id="r1", attempt=0))  # not the running attempt
    rig["cm"].put(TEReport(te_id="te0", num_waiting=0, num_running=1, load_tokens=0,
                           kv_usage=0.0))
    _pump(rig, lambda: rig["je"].router.reports.get("te0"))
    assert _recv(rig["te"]["te0"]) is None
    rig["cm"].put(TEReport(te_id="te0", num_waiting=0, num_running=0, load_tokens=0,
                           kv_usage=0.0, finished=["r1"]))  # the report frees it too
    assert _pump(rig, lambda: _recv(rig["te"]["te0"])).request_id == "r2"


def test_a_tenant_past_its_limit_is_refused_with_retry_after(rig):
    rig["je"].share = FairShare(TenantsSection(max_requests=1, retry_after_s=7))
    _listed(rig, ["te0"])
    _submit(rig, "a1", "a")
    _pump(rig, lambda: _recv(rig["te"]["te0"]))
    _submit(rig, "a2", "a")
    failed = _pump(rig, lambda: _recv(rig["gw"]))
    assert isinstance(failed, RequestFailed) and failed.request_id == "a2"
    assert failed.error == "rate_limited" and failed.retry_after_s == 7
    rig["to_je"].put(TaskDone(request_id="a1"))
    _pump(rig, lambda: rig["je"].share.num_requests["a"] == 0 or None)
    _submit(rig, "a3", "a")  # a slot and a place again
    assert _pump(rig, lambda: _recv(rig["te"]["te0"])).request_id == "a3"


def test_requests_waiting_for_a_te_that_dies_go_elsewhere_or_fail(rig, monkeypatch):
    monkeypatch.setattr(job_executor, "PARK_S", 0.5)
    _listed(rig, ["te0"])
    _submit(rig, "a1", "a")
    _pump(rig, lambda: _recv(rig["te"]["te0"]))
    _submit(rig, "a2", "a")
    _submit(rig, "b1", "b")
    _queued(rig, 2)
    _listed(rig, ["te1"])  # te0 died, te1 came up
    lost = _pump(rig, lambda: _recv(rig["gw"]))
    assert lost.request_id == "a1" and lost.error == "te_lost"
    assert _pump(rig, lambda: _recv(rig["te"]["te1"])).request_id == "a2"
    _listed(rig, [])  # no TE at all: b1 waits no more in the fair queue, but parked
    _queued(rig, 0)
    failed = [_pump(rig, lambda: _recv(rig["gw"])) for _ in range(2)]
    assert {(f.request_id, f.error) for f in failed} == {("a2", "te_lost"),
                                                         ("b1", "engine_dead")}
    started = time.monotonic()
    assert rig["je"].share.num_requests == {} and not rig["je"].tasks
    assert time.monotonic() - started < 1.0


def test_an_aborted_waiting_request_leaves_the_queue_and_its_count(rig):
    from deepserve.messages.engine import AbortRequest
    _listed(rig, ["te0"])
    _submit(rig, "a1", "a")
    _pump(rig, lambda: _recv(rig["te"]["te0"]))
    _submit(rig, "a2", "a")
    _queued(rig, 1)
    rig["to_je"].put(AbortRequest(request_id="a2"))
    _queued(rig, 0)
    assert rig["je"].share.num_requests == {"a": 1}


def test_the_te_is_told_each_tenants_weight(rig):
    """[tenants] weights reach the TE with each task (SubmitRequest.tenant_weight):
    its scheduler shares a step among tenants by them (engine/scheduler.py)."""
    rig["je"].share = FairShare(msgspec.convert(
        {"weight": 2.0, "named": {"gold": {"weight": 5.0}}}, TenantsSection))
    _listed(rig, ["te0"])
    sent = {}
    for rid, tenant in [("g1", "gold"), ("o1", "other")]:
        _submit(rig, rid, tenant)
        task = _pump(rig, lambda: _recv(rig["te"]["te0"]))
        sent[task.request_id] = task.tenant_weight
        rig["to_je"].put(TaskDone(request_id=rid))
    assert sent == {"g1": 5.0, "o1": 2.0}

