"""Cluster-wide placement (control/cm/hosts.py) and the scaling loop that uses
it (control/cm/scaling.py): which node a scaled TE goes to, what a ScaleOut
to a joined node carries, and a lost node's TEs started elsewhere, on a fake
clock."""

from __future__ import annotations

import msgspec

from deepserve.config.models import ModelSpec, ScalingSection
from deepserve.control.cm.hosts import HostBook
from deepserve.control.cm.scaling import ScalingControl, options_of, policies_of, targets_of
from deepserve.messages.control import TEInfo
from deepserve.messages.scaling import (ModelDemand, NodeReport, ScaleEvent, ScaleIn, ScaleOut,
                                       StaticTE)

GB = 1 << 30


def node(name, run_id="r1", free=None, pods=0, cached=(), tes=None, taken=0, mem=8 * GB,
         serves=()):
    return NodeReport(node=name, run_id=run_id, address=f"tcp://{name}:7404",
                      free_devices=free, available_bytes=mem, ready_pods=pods,
                      cached=list(cached), tes=tes or {}, scale_outs=taken,
                      weights=f"tcp://{name}:7405", serves=list(serves))


def book(*reports, now=0.0):
    b = HostBook(timeout_s=3.0)
    for r in reports:
        b.on_report(r, now)
    return b


def test_replicas_spread_first_then_a_ready_pod_then_the_weight_cache():
    assert book(node("a", tes={"a-m-0": "m"}, pods=1, cached=["/m"]),
                node("b")).choose("m", "/m") == "b"  # a holds a replica already
    assert book(node("a", cached=["/m"]), node("b", pods=1)).choose("m", "/m") == "b"
    assert book(node("a"), node("b", cached=["/m"])).choose("m", "/m") == "b"
    assert book(node("a"), node("b")).choose("m", "/m") == "a"  # ties: the first name
    assert book(node("a", free=1), node("b", free=3)).choose("m", "/m") == "b"


def test_a_node_without_the_devices_or_the_memory_is_no_candidate():
    b = book(node("a", free=1), node("b", free=0), node("c", mem=GB))
    assert b.choose("m", "/m", devices=2, size=2 * GB) is None  # tp 2: a has 1, b 0;
    assert b.choose("m", "/m", devices=2) == "c"  # c has no device limit, too little memory
    assert b.choose("m", "/m", devices=1, size=2 * GB) == "a"


def test_a_placement_holds_its_devices_until_the_node_reports_it_took_the_order():
    b = book(node("a", free=1), node("b", free=1))
    assert b.choose("m", "/m") == "a"
    b.placed("a", "m")
    assert b.choose("m", "/m") == "b"  # a's one device is spoken for
    b.on_report(node("a", free=1, taken=0), 0.5)  # sent before the order arrived
    assert b.choose("x", "/x") == "b"
    b.placed("b", "m")
    assert b.choose("x", "/x") is None
    b.on_report(node("a", free=0, taken=1, tes={"a-m-0": "m"}), 1.0)  # took it
    b.on_report(node("b", free=1, taken=0), 1.0)
    assert b.choose("x", "/x") is None  # b's order is still in flight
    b.withdraw("b", "m", 1)  # ... and was never delivered
    assert b.choose("x", "/x") == "b"


def test_a_silent_node_is_lost_once_and_back_when_it_reports_again():
    b = book(node("a", tes={"a-m-0": "m"}), node("b"))
    b.on_report(node("b"), 2.0)
    assert b.expire(3.5) == ["a"] and b.expire(4.0) == []
    assert b.is_lost("a") and b.node_of("a-m-0") == "a" and b.address("a") is None
    assert b.choose("m", "/m") == "b" and b.alive() == ["b"]
    assert b.on_report(node("a", run_id="r2"), 5.0)  # restarted: a new run, joined again
    assert not b.is_lost("a") and b.alive() == ["a", "b"]
    assert not b.on_report(node("a", run_id="r2"), 6.0)  # the same run: nothing new
    b.expire(20.0)
    assert b.on_report(node("a", run_id="r2"), 21.0)  # back after it was lost
    own = HostBook(timeout_s=3.0, local="tcp://a:7404")  # the CM's own node
    own.on_report(node("a"), 0.0)
    assert own.expire(60.0) == [] and own.alive() == ["a"]


def test_fork_sources_are_live_holders_memory_first_never_the_target():
    b = book(node("a", serves=["/m"]), node("b", serves=["/m"], cached=["/m"]),
             node("c", serves=["/x"]), node("d", serves=["/m"]))
    assert b.sources("/m", exclude="d") == ["tcp://b:7405", "tcp://a:7405"]
    b.on_report(node("a", serves=["/m"]), 5.0)
    b.expire(5.0)  # b, c, d silent since 0
    assert b.sources("/m") == ["tcp://a:7405"] and b.sources("/y") == []


# -- the scaling loop with placement ---------------------------------------------------

def control(min_tes=0, max_tes=2):
    sent, to, events = [], [], []
    spec = ModelSpec(name="m", path="/models/m", min_tes=min_tes, max_tes=max_tes,
                     options={"max_num_seqs": 4})
    c = ScalingControl(policies_of([spec]), options_of(ScalingSection()), sent.append,
                       lambda event, **d: events.append((event, d)), 0.0, 60.0, {},
                       hosts=HostBook(3.0), send_to=lambda a, m: to.append((a, m)),
                       targets=targets_of([spec]))
    return c, sent, to, events


def te(te_id):
    return TEInfo(te_id=te_id, model="m", address=f"tcp://{te_id}")


def test_a_scale_out_waits_for_the_first_node_report():
    """A CM that just started knows no node: the scale-out waits (logged once),
    then goes to the first node that reports (on one host: the CM's own)."""
    c, sent, to, events = control(min_tes=1)
    c.step(0.0, {})
    assert sent == [] and to == [] and [e for e, _ in events].count("scale_unplaced") == 1
    c.on_node_report(node("", free=None), 0.5)
    c.on_node_report(node("", free=None), 1.5)
    c.step(1.6, {})
    assert [(a, type(m)) for a, m in to] == [("tcp://:7404", ScaleOut)]
    [joined] = [d for e, d in events if e == "node_joined"]  # once, at its first report
    assert joined["node"] == "" and joined["run_id"] == "r1"


def test_a_model_at_zero_starts_on_the_chosen_node_with_its_path_and_options():
    c, sent, to, events = control()
    c.on_node_report(node("head", free=0, serves=["/models/m"]), 0.0)
    c.on_node_report(node("h1", free=1), 0.0)
    c.on_demand(ModelDemand(parked={"m": 1}), 0.1)
    c.step(0.2, {})
    [(address, out)] = to
    assert address == "tcp://h1:7404" and sent == []
    assert (out.model, out.count, out.reason) == ("m", 1, "demand_from_zero")
    [decision] = [d for e, d in events if e == "scale_decision"]
    assert decision["placed"] == {"h1": 1}
    assert (out.path, out.options) == ("/models/m", {"max_num_seqs": 4})
    assert out.sources == ["tcp://head:7405"]  # h1 may lack the files: fork them from these
    c.step(0.4, {})  # starting on h1: not asked again
    assert len(to) == 1


def test_no_room_anywhere_is_logged_once_and_placed_when_room_appears():
    c, sent, to, events = control(min_tes=1)
    c.on_node_report(node("head", free=0), 0.0)
    c.step(0.1, {})
    c.step(0.3, {})
    assert to == [] and sent == []
    assert [e for e, _ in events].count("scale_unplaced") == 1
    assert [e for e, _ in events].count("scale_decision") == 1  # not once a step
    c.on_node_report(node("h1"), 0.5)
    c.step(0.6, {})
    assert [a for a, _ in to] == ["tcp://h1:7404"]
    assert [e for e, _ in events].count("scale_decision") == 2  # ... and once placed


def test_a_lost_nodes_te_is_started_on_another_node_at_once():
    """h1 runs m's only TE and goes silent: its TE leaves the list, the node is
    lost, and the next step places a new TE on h2 (no wait for a restart
    that nobody will do)."""
    c, sent, to, events = control(min_tes=1)
    c.on_node_report(node("h1", tes={"h1-m-0": "m"}, taken=1), 0.0)
    c.on_node_report(node("h2"), 0.0)
    c.on_te_up(te("h1-m-0"), 0.0)
    c.step(0.1, {"h1-m-0": te("h1-m-0")})
    assert to == []
    c.on_node_report(node("h2"), 3.0)
    c.on_te_down("h1-m-0", "m", "no report for 3.0 s", 3.2)  # before the node is lost
    c.step(3.5, {})
    [lost] = [d for e, d in events if e == "node_lost"]
    assert lost == {"node": "h1", "tes": ["h1-m-0"], "dropped": ["h1-m-0"]}
    [(address, out)] = to
    assert address == "tcp://h2:7404" and out.reason == "min_tes"


def test_a_scale_in_goes_to_the_node_that_runs_the_te_and_a_refusal_frees_the_slot():
    c, sent, to, _ = control(min_tes=0, max_tes=2)
    c.on_node_report(node("h1", tes={"h1-m-0": "m"}, taken=1), 0.0)
    c.on_te_up(te("h1-m-0"), 0.0)
    c.draining["h1-m-0"] = ("m", 0.0)
    from deepserve.messages.control import TEReport
    c.on_report(TEReport(te_id="h1-m-0", num_waiting=0, num_running=0, load_tokens=0,
                         kv_usage=0.0), "m", 2.0)
    assert to == [("tcp://h1:7404", ScaleIn(te_id="h1-m-0", model="m", reason="drained"))]
    c.starting["m"].append((100.0, "h1"))
    c.on_scale_event(ScaleEvent(model="m", te_id="", direction="failed"))
    assert c.starting["m"] == []


def test_nodes_that_fork_one_scale_out_form_a_chain_from_the_holder():
    """min_tes 3 from zero onto three nodes without the files: h1 forks from the
    head, h2 from h1 first, h3 from h2 first (each relays its copy under way);
    a node that has the files gets no relay and is no link."""
    c, sent, to, events = control(min_tes=3, max_tes=3)
    c.on_node_report(node("head", free=0, serves=["/models/m"], cached=["/models/m"]), 0.0)
    for name in ("h1", "h2", "h3"):
        c.on_node_report(node(name), 0.0)
    c.step(0.1, {})
    assert {a: m.sources for a, m in to} == {
        "tcp://h1:7404": ["tcp://head:7405"],
        "tcp://h2:7404": ["tcp://h1:7405", "tcp://head:7405"],
        "tcp://h3:7404": ["tcp://h2:7405", "tcp://head:7405"]}
    c2, _, to2, _ = control(min_tes=2, max_tes=2)
    c2.on_node_report(node("h1", serves=["/models/m"]), 0.0)  # has them: no fork
    c2.on_node_report(node("h2"), 0.0)
    c2.step(0.1, {})
    assert {a: m.sources for a, m in to2} == {"tcp://h1:7404": [],
                                               "tcp://h2:7404": ["tcp://h1:7405"]}


def test_a_lost_nodes_colocated_static_tes_start_elsewhere_once():
    """h2's [[te]] TEs (a colocated one and a decode one) go with it: the
    colocated one is started on h1 at once, as a scaled TE of its model from
    its path (forked if h1 lacks it); the decode one is not (a PD pair is a
    layout); a later step does not start it again. Also without [[model]]s."""
    sent, to, events = [], [], []
    c = ScalingControl([], options_of(ScalingSection()), sent.append,
                       lambda event, **d: events.append((event, d)), 0.0, 60.0, {},
                       hosts=HostBook(3.0), send_to=lambda a, m: to.append((a, m)))
    static = [StaticTE("h2-te0", "tiny", "/models/tiny"),
              StaticTE("h2-te1", "tiny", "/models/tiny", "decode")]
    c.on_node_report(msgspec.structs.replace(node("h2", serves=["/models/tiny"]),
                                             static=static), 0.0)
    c.on_node_report(node("h1"), 0.0)
    c.step(0.1, {})
    assert to == []
    c.on_node_report(node("h1"), 3.0)
    c.step(3.5, {})  # h2 silent for 3.5 s: lost
    [(address, out)] = to
    assert address == "tcp://h1:7404" and sent == []
    assert (out.model, out.count, out.reason, out.path) == ("tiny", 1, "replace_lost",
                                                             "/models/tiny")
    assert out.sources == []  # the only holder is the lost node: h1 has it, or it cannot
    [decision] = [d for e, d in events if e == "scale_decision"]
    assert decision["replaces"] == ["h2-te0"] and decision["placed"] == {"h1": 1}
    c.on_node_report(node("h1"), 4.0)
    c.step(6.0, {})
    assert len(to) == 1  # once per loss
