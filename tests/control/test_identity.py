"""control/identity.py: what each member's key may tell the cluster manager and
the job executor (pure: the rules, given who sent what)."""

from __future__ import annotations

import pytest

from deepserve.control.identity import cm_admit, je_admit
from deepserve.ipc import curve, curve_keys
from deepserve.messages.cache import TierReport
from deepserve.messages.control import TEDown, TEInfo, TEReport, TEUp
from deepserve.messages.engine import AbortRequest, RequestDelta, SubmitRequest
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.scaling import ModelDemand, NodeReport, ScaleEvent, StaticTE

N1 = ("n1", "")
HEAD = ("h0", curve_keys.HEAD)
OWN = ("me", "")  # this process's own node (the head's CM)


@pytest.fixture(autouse=True)
def as_node_me(tmp_path, monkeypatch):
    curve_keys.make_keys(tmp_path / "k")
    curve_keys.make_node_key(tmp_path / "k", "me")
    monkeypatch.setenv(curve.ENV_VAR, str(tmp_path / "k"))
    monkeypatch.setenv(curve.NODE_ENV_VAR, "me")


def _up(te_id: str) -> TEUp:
    return TEUp(info=TEInfo(te_id=te_id, model="m", address="tcp://h:1"))


def _report(te_id: str) -> TEReport:
    return TEReport(te_id=te_id, num_waiting=0, num_running=0, load_tokens=0, kv_usage=0.0)


@pytest.mark.parametrize("msg", [
    _up("n1-te0"), TEDown(te_id="n1-te0", reason="x"), _report("n1-tiny-3"),
    ScaleEvent(model="m", te_id="n1-tiny-0", direction="out"),
    NodeReport(node="n1", run_id="r", address="a", tes={"n1-tiny-0": "m"},
               static=[StaticTE("n1-te0", "m", "/m")]),
    TierReport(peer="tcp://h:7407")])
def test_a_node_speaks_for_its_own_tes(msg):
    assert cm_admit(N1, msg) == ""


@pytest.mark.parametrize("msg", [
    _up("n2-te0"), _up("te0"), _up("n1"), _up("n10-te0"), TEDown(te_id="n2-te0", reason="x"),
    _report("n2-te0"), ScaleEvent(model="m", te_id="te0", direction="in"),
    NodeReport(node="n2", run_id="r", address="a"),
    NodeReport(node="n1", run_id="r", address="a", tes={"n2-tiny-0": "m"}),
    NodeReport(node="n1", run_id="r", address="a", static=[StaticTE("te0", "m", "/m")]),
    ModelDemand(arrivals={"m": 5})])
def test_not_for_another_nodes_nor_the_heads(msg):
    assert cm_admit(N1, msg)  # a reason


@pytest.mark.parametrize("member", [HEAD, OWN])
def test_a_head_and_the_cms_own_node_say_anything(member):
    for msg in (_up("te0"), _up("n2-te0"), ModelDemand(arrivals={"m": 1}),
                TEDown(te_id="n1-te0", reason="x")):
        assert cm_admit(member, msg) == ""


def test_the_job_executor_takes_requests_only_from_heads_and_te_output_from_members():
    submit = SubmitRequest(request_id="r", prompt="x", tenant="a", sampling=SamplingParams())
    for msg in (submit, AbortRequest(request_id="r")):
        assert je_admit(N1, msg) and je_admit(HEAD, msg) == "" and je_admit(OWN, msg) == ""
    assert je_admit(N1, RequestDelta(request_id="r", text="x", token_ids=[1])) == ""
