"""NodeScaler (supervisor/scaler.py) against a fake node: the pool, adopting
a pre-warmed process with an Assign, stage timings whatever order Ready and
the TE list come in, replacement of a failed TE, and scale-in."""

from __future__ import annotations

import threading
import time

import zmq

from deepserve.cache.weight_fork import Forked, ForkError
from deepserve.config.models import ModelSpec, ScalingSection
from deepserve.ipc.sockets import PullSocket
from deepserve.messages.health import Ready
from deepserve.messages.scaling import Assign, ScaleEvent, ScaleIn, ScaleOut
from deepserve.supervisor.node_config import NodeConfig, TESpec
from deepserve.supervisor.scaler import MAX_SCALE_OUT, READY_WAIT_S, NodeScaler


class _Popen:
    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


class _Table:
    def __init__(self):
        self.procs, self.incarnations, self.stopped = {}, {}, []

    def __contains__(self, name):
        return name in self.procs

    def poll(self, name):
        return self.procs[name].poll()

    def pid(self, name):
        return self.procs[name].pid

    def remove(self, name):
        del self.procs[name]

    def next_incarnation(self, name):
        return self.incarnations.get(name, -1) + 1

    def stop(self, name, grace_s):
        self.procs[name].returncode = 0
        self.stopped.append(name)

    def sweep(self, name):
        return []


class _Run:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.node_inbox, self.hb, self.weights = "", f"ipc://{tmp_path}/hb.sock", ""

    def te_address(self, name):
        return f"ipc://{self.tmp}/{name}.sock"


class _Models:
    """As NodeModels: /m is held here; fork() is the test's."""

    def __init__(self):
        self.fork_result = None  # a Forked, or an exception to raise
        self.forks = []

    def holds(self, path):
        return path == "/m"

    def holdings(self):
        return ["/m"], ["/m"]

    def fork(self, path, sources):
        self.forks.append((path, list(sources)))
        if isinstance(self.fork_result, Exception):
            raise self.fork_result
        return self.fork_result


class FakeNode:
    def __init__(self, tmp_path, pool_size=1, **node):
        self.config = NodeConfig.build(
            models=[ModelSpec(name="m", path="/m", min_tes=1)],
            scaling=ScalingSection(pool_size=pool_size), **node)
        self.ctx = zmq.Context()
        self.table, self.run, self.te_ids = _Table(), _Run(tmp_path), []
        self.events, self.spawned, self.pids = [], [], iter(range(100, 1000))
        self.run_id, self.placed, self.learned, self.bound = "r", [], {}, []
        self.models = _Models()

    def model_spec(self, name, path="", options=None):
        """As Node.model_spec: declared, or learned from a ScaleOut's path when
        its files are here (held, or forked)."""
        try:
            return self.config.model_spec(name)
        except KeyError:
            here = path in ("/big", "/m") or any(f[0] == path for f in self.models.forks)
            if path and here and name not in self.learned:
                self.learned[name] = ModelSpec(name=name, path=path, options=options or {})
            return self.learned.get(name)

    def scaled_te_id(self, spec, n):
        return spec.te_id(n)

    def bind_te(self, te_id):
        self.bound.append(te_id)

    def spawn_pod(self, name):
        self.table.procs[name] = _Popen(next(self.pids))

    def spawn_te(self, te_id, model):
        self.spawned.append((te_id, model))
        self.table.procs[te_id] = _Popen(next(self.pids))

    def adopt_pod(self, pod, te_id, model):
        self.table.incarnations[te_id] = self.table.next_incarnation(te_id)
        self.table.procs[te_id] = self.table.procs.pop(pod)

    def te_run_id(self, te_id, incarnation):
        return f"r{te_id}-{incarnation}"

    @property
    def health(self):
        node = self

        class _Log:
            def write(self, component, event, pid=None, **details):
                node.events.append((component, event, details))
        return _Log()


def _scaler(tmp_path, pool_size=1, **node):
    node = FakeNode(tmp_path, pool_size, **node)
    told = []
    scaler = NodeScaler(node, told.append, clock=lambda: 0.0)
    return node, scaler, told


def _ready(name, t, **details):
    return Ready(component=name, pid=1, time=t, details=details)


def test_a_ready_pod_becomes_the_new_te_and_the_pool_refills_after(tmp_path):
    node, scaler, told = _scaler(tmp_path)
    scaler.fill_pool()
    assert list(scaler.pods) == ["pool0"] and not scaler.pods["pool0"]
    assert scaler.on_message(_ready("pool0", 1.0, pool=True), 1.0)
    pull = PullSocket(node.ctx, node.run.te_address("pool0"), bind=True, type=Assign)
    try:
        scaler.on_message(ScaleOut(model="m", count=1, reason="queue", decided_at=9.5), 10.0)
        assign = pull.get(timeout=5)
    finally:
        pull.close()
    assert (assign.te_id, assign.model, assign.run_id) == ("m-1", "m", "rm-1-0")
    assert "m-1" in node.te_ids and node.spawned == [] and not scaler.pods
    scaler.fill_pool()
    assert not scaler.pods  # a TE is starting: the refill waits for it
    scaler.on_message(_ready("m-1", 10.6, stages={"te_pre_load": 0.2, "te_load": 0.1,
                                                  "te_post_load": 0.1}, weights="cache"), 10.7)
    scaler.on_te_list({"m-1"}, 10.8)
    [(te, event, details)] = [e for e in node.events if e[1] == "scaled_out"]
    assert (te, details["source"], details["reason"]) == ("m-1", "prewarmed_cache", "queue")
    assert details["total_s"] == 1.3 and details["stages"]["scaler_post"] == 0.2
    assert set(details["stages"]) == {"scaler_pre", "te_pre_load", "te_load", "te_post_load",
                                      "scaler_post"}
    assert [type(m) for m in told] == [ScaleEvent] and told[0].direction == "out"
    scaler.fill_pool()
    assert list(scaler.pods) == ["pool1"]
    scaler.close()
    node.ctx.term()


def test_listed_before_its_ready_waits_for_the_stages(tmp_path):
    node, scaler, told = _scaler(tmp_path, pool_size=0)
    scaler.scale_out("m", 2, "min_tes", 0.0)
    assert node.spawned == [("m-1", "m"), ("m-2", "m")]  # no pod: cold
    scaler.on_te_list({"m-1", "m-2"}, 5.0)
    assert not [e for e in node.events if e[1] == "scaled_out"]
    scaler.on_message(_ready("m-1", 4.9, stages={"te_load": 1.0}), 5.1)
    scaler.on_te_list({"m-1", "m-2"}, 5.0 + READY_WAIT_S)
    outs = {e[0]: e[2] for e in node.events if e[1] == "scaled_out"}
    assert outs["m-1"]["stages"]["te_load"] == 1.0 and outs["m-1"]["source"] == "cold"
    assert "te_load" not in outs["m-2"]["stages"]  # its Ready never came: logged anyway
    scaler.close()
    node.ctx.term()


def test_a_failed_te_is_replaced_from_the_pool_and_scale_in_retires_one(tmp_path):
    node, scaler, told = _scaler(tmp_path)
    scaler.start_te("m-0", "m", "min_tes", 0.0)
    assert not scaler.replace("m-0", 1.0)  # no ready pod: the supervisor respawns it
    scaler.starting.clear()
    scaler.fill_pool()
    scaler.on_message(_ready("pool0", 1.0), 1.0)
    node.table.procs["m-0"].returncode = -9
    assert scaler.replace("m-0", 2.0) and node.table.incarnations["m-0"] == 0
    assert scaler.starting["m-0"].reason == "replace"
    scaler.on_message(ScaleIn(te_id="m-0", model="m", reason="drained"), 3.0)
    assert scaler.is_retiring("m-0")
    for _ in range(100):
        if "m-0" in scaler.stopped:
            break
        import time
        time.sleep(0.01)
    scaler.tick(4.0)
    assert "m-0" not in node.table and "m-0" not in node.te_ids
    assert [e[1] for e in node.events if e[0] == "m-0"] == ["scaled_in"]
    assert told[-1] == ScaleEvent(model="m", te_id="m-0", direction="in")
    scaler.close()
    node.ctx.term()


def test_a_start_waits_for_a_warming_pod_and_goes_cold_if_it_dies(tmp_path):
    node, scaler, _ = _scaler(tmp_path, pool_size=1)
    scaler.fill_pool()  # pool0 warming
    assert scaler.replace("zz-0", 1.0) is False  # no TE of ours
    assert scaler.replace("m-0", 1.0) and scaler.is_waiting("m-0")
    scaler.tick(2.0)
    assert scaler.is_waiting("m-0") and node.spawned == []  # no cold start beside the pod
    scaler.start_te("m-1", "m", "queue", 2.0)  # one pod warming, two starts: m-1 goes cold
    assert node.spawned == [("m-1", "m")] and not scaler.is_waiting("m-1")
    scaler.on_message(_ready("pool0", 3.0), 3.0)
    scaler.tick(3.0)
    assert not scaler.is_waiting("m-0") and "pool0" not in scaler.pods
    assert scaler.starting["m-0"].source == "prewarmed"
    assert scaler.starting["m-0"].given_at is not None
    scaler.starting.clear()
    scaler.fill_pool()  # pool1 warming
    scaler.start_te("m-2", "m", "queue", 4.0)
    assert scaler.is_waiting("m-2")
    node.table.procs["pool1"].returncode = 1  # the pod died
    scaler.tick(5.0)
    assert node.spawned[-1] == ("m-2", "m") and scaler.starting["m-2"].source == "cold"
    scaler.close()
    node.ctx.term()


def test_an_adopted_pods_assign_socket_is_closed_once_its_te_is_up(tmp_path):
    """Found by bin/deepserve-chaos (25 min, 32 faults): the supervisor's open
    fds grew by about one per replaced TE, a PUSH socket to every adopted
    pod's inbox (pool0, pool1, ...) kept forever. Once the pod answers as its
    TE (Ready), nothing is sent to that inbox again: its socket is closed."""
    node, scaler, _ = _scaler(tmp_path)
    for i in range(3):
        pod = f"pool{i}"
        scaler.fill_pool()
        scaler.on_message(_ready(pod, 1.0), 1.0)
        pull = PullSocket(node.ctx, node.run.te_address(pod), bind=True, type=Assign)
        try:
            scaler.start_te(f"m-{i}", "m", "replace", 2.0)
            assert pull.get(timeout=5).te_id == f"m-{i}"
            assert len(scaler.assigns) == 1  # its pod's, until the pod answers as the TE
            scaler.on_message(_ready(f"m-{i}", 2.5), 2.6)
            scaler.on_te_list({f"m-{j}" for j in range(i + 1)}, 2.7)
        finally:
            pull.close()
    assert len(scaler.assigns) == 0
    scaler.close()
    node.ctx.term()


def test_a_scale_out_starts_what_the_free_devices_take_and_refuses_the_rest(tmp_path):
    """num_devices 3, a tp=2 model: the first TE fits, the second is refused at
    once (a ScaleEvent "failed": the CM's slot frees); the report counts both
    orders as taken and the devices as held."""
    node, scaler, told = _scaler(tmp_path, pool_size=0, num_devices=3)
    scaler.on_message(ScaleOut(model="big", count=2, path="/big", options={"tp": 2}), 1.0)
    assert [t for t, _ in node.spawned] == ["big-0"] and node.bound == ["big-0"]
    [refused] = [m for m in told if isinstance(m, ScaleEvent)]
    assert (refused.model, refused.direction, refused.reason) == ("big", "failed",
                                                                   "no free devices")
    assert [e[1] for e in node.events] == ["scale_refused"]
    report = scaler.report()
    assert report.free_devices == 1 and report.scale_outs == 2
    assert report.tes == {"big-0": "big"} and report.cached == ["/m"]
    scaler.on_message(ScaleOut(model="nope", count=1), 2.0)  # unknown here, no path
    assert told[-1].direction == "failed" and told[-1].reason == "unknown model"
    assert scaler.report().scale_outs == 3
    scaler.close()


def test_a_scaled_te_frees_its_devices_once_scaled_in(tmp_path):
    node, scaler, told = _scaler(tmp_path, pool_size=0, num_devices=1)
    scaler.on_message(ScaleOut(model="m", count=1), 1.0)
    assert scaler.free_devices() == 0 and scaler.fits(node.config.model_spec("m"), 1) == 0
    [(te_id, _)] = node.spawned
    scaler.on_message(ScaleIn(te_id=te_id, model="m"), 2.0)
    deadline = time.monotonic() + 5
    while te_id not in scaler.stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    scaler.tick(3.0)
    assert scaler.free_devices() == 1 and scaler.report().tes == {}
    scaler.close()


def test_a_scale_out_count_is_bounded_at_both_ends(tmp_path):
    """A count from the wire: 65 starts MAX_SCALE_OUT (64) TEs, -3 and 0 start none."""
    node, scaler, told = _scaler(tmp_path, pool_size=0)
    scaler.on_message(ScaleOut(model="m", count=-3), 1.0)
    scaler.on_message(ScaleOut(model="m", count=0), 1.0)
    assert node.spawned == []
    scaler.on_message(ScaleOut(model="m", count=MAX_SCALE_OUT + 1), 2.0)
    assert len(node.spawned) == MAX_SCALE_OUT == 64
    scaler.close()


def _wait_forked(scaler, path):
    deadline = time.monotonic() + 5
    while path not in scaler.forked and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_model_not_on_this_host_is_forked_once_then_its_tes_start(tmp_path):
    """Two scale-outs of a model whose files are not here: one fork (from the
    sources the CM named), then both TEs, timed with a fork stage; the devices
    they will take are held meanwhile."""
    node, scaler, told = _scaler(tmp_path, pool_size=0, num_devices=4)
    node.models.fork_result = Forked(source="tcp://peer:7405", bytes=123, seconds=0.5)
    order = dict(path="/far", options={"tp": 2}, sources=["tcp://peer:7405"])
    gate = threading.Event()
    fork = node.models.fork
    node.models.fork = lambda p, s: (gate.wait(5), fork(p, s))[1]
    scaler.on_message(ScaleOut(model="far", count=1, **order), 1.0)
    scaler.on_message(ScaleOut(model="far", count=1, **order), 1.1)
    assert node.spawned == [] and scaler.free_devices() == 0  # 2 x tp 2, forking
    gate.set()
    _wait_forked(scaler, "/far")
    scaler.tick(2.0)
    assert node.models.forks == [("/far", ["tcp://peer:7405"])]
    assert [t for t, _ in node.spawned] == ["far-0", "far-1"]
    assert ("/far", "weights_forked") in [(c, e) for c, e, _ in node.events]
    scaler.on_message(_ready("far-0", 2.5, stages={"te_load": 0.1}), 2.6)
    scaler.on_te_list({"far-0"}, 2.7)
    [(_, _, details)] = [e for e in node.events if e[1] == "scaled_out"]
    assert details["stages"]["fork"] == 0.5 and details["weights"] == "fork"
    scaler.close()


def test_a_fork_no_source_gives_refuses_its_tes_and_none_is_tried_without_sources(tmp_path):
    node, scaler, told = _scaler(tmp_path, pool_size=0)
    node.models.fork_result = ForkError("no source gave /far")
    scaler.on_message(ScaleOut(model="far", count=2, path="/far", sources=["tcp://p:1"]), 1.0)
    _wait_forked(scaler, "/far")
    scaler.tick(2.0)
    assert node.spawned == [] and [m.direction for m in told] == ["failed", "failed"]
    assert "fork failed" in told[0].reason and ("/far", "fork_failed") in [
        (c, e) for c, e, _ in node.events]
    scaler.on_message(ScaleOut(model="far2", count=1, path="/far2"), 3.0)  # nobody to ask
    assert told[-1].reason == "no model files here and no peer has them"
    assert len(node.models.forks) == 1
    scaler.close()


def test_a_scale_in_stops_only_a_scaled_te(tmp_path):
    """ScaleIn reaches a joined node over tcp: one naming a [[te]] TE, or a
    process that is no TE (a pod), stops nothing."""
    node, scaler, told = _scaler(tmp_path, pool_size=1, model="/s",
                                 tes=[TESpec("te0", "colocated")])
    node.table.procs["te0"] = _Popen(7)
    scaler.fill_pool()
    for name in ("te0", "pool0", "nobody"):
        scaler.on_message(ScaleIn(te_id=name, model="m"), 1.0)
    assert scaler.retiring == {} and node.table.stopped == []
    scaler.close()


def test_a_dropped_fork_is_gone_and_held_no_more(tmp_path):
    """NodeModels.drop_fork: the copy removed, the path no longer held here (a
    later order forks it again); an unknown path is nothing to drop."""
    from deepserve.supervisor.node_models import NodeModels
    config = NodeConfig.build(model="/m", tes=[TESpec("te0", "colocated")])
    models = NodeModels(config, None, tmp_path / "forks")
    copy = tmp_path / "forks" / "m-1"
    copy.mkdir(parents=True)
    (copy / "config.json").write_text("{}")
    models.forked["/far/m"] = copy
    assert models.holds("/far/m") and "/far/m" in models.served()
    models.drop_fork("/far/m")
    assert not copy.exists() and not models.holds("/far/m") and "/far/m" not in models.served()
    models.drop_fork("/never")  # nothing to do
