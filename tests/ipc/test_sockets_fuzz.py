"""A crafted frame on any internal socket is logged and dropped, never fatal.

Every actor's inbox type is fuzzed through the typed socket's decoder with
random bytes, random msgpack of the wrong shape and unknown tags; real
sockets then show `get` / `drain` skip garbage and deliver what follows, and
real ClusterManager / JobExecutor objects keep working after a burst of it.
"""

from __future__ import annotations

import functools
import logging
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepserve.control.je.job_executor import _IN as ToJobExecutor
from deepserve.ipc import sockets
from deepserve.ipc.sockets import PubSocket, PullSocket, ipc_address
from deepserve.messages.control import (FromClusterManager, TEInfo, TEList, TEUp,
                                        ToClusterManager)
from deepserve.messages.engine import (AbortRequest, FromWorker, ToClient, ToMaster,
                                       ToTokenizer)
from deepserve.messages.health import ToSupervisor
from deepserve.messages.pd import ToPeer

# channel -> (inbox type, the actor that reads it)
INBOXES = {
    "master.requests": ToMaster, "master.pd": ToPeer, "master.steps": FromWorker,
    "tokenizer": ToTokenizer, "job_executor": ToJobExecutor,
    "job_executor.cm": FromClusterManager, "cluster_manager": ToClusterManager,
    "supervisor": ToSupervisor, "client": ToClient,
}
SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=6), children, max_size=4), max_leaves=20)


@functools.cache  # msgspec.inspect per draw was a fifth of this module's time
def _infos(union) -> tuple:
    return tuple(msgspec.inspect.type_info(t) for t in getattr(union, "__args__", (union,)))


def _tags(union) -> list[str]:
    return [info.tag for info in _infos(union)]


def _field_names(union, tag: str) -> list[str]:
    for info in _infos(union):
        if info.tag == tag:
            return [f.name for f in info.fields]
    return []


def _tag_field(union) -> str:
    return _infos(union)[0].tag_field


@st.composite
def wrong_shapes(draw, union) -> bytes:
    """msgpack that looks like one of the channel's messages, or nothing like it:
    a known tag with random fields, an unknown tag, or any value at all."""
    kind = draw(st.sampled_from(["any", "known_tag", "unknown_tag"]))
    if kind == "any":
        return msgspec.msgpack.encode(draw(msgpack_values))
    tag = draw(st.sampled_from(_tags(union))) if kind == "known_tag" else draw(
        st.text(min_size=1, max_size=10).filter(lambda t: t not in _tags(union)))
    names = _field_names(union, tag)  # the real names (none for an unknown tag)
    fields = draw(st.lists(msgpack_values, min_size=len(names), max_size=max(8, len(names))))
    as_dict = draw(st.booleans())  # array_like Structs take arrays; try maps too
    if as_dict:
        keys = names + [f"x{i}" for i in range(len(fields) - len(names))]
        return msgspec.msgpack.encode({_tag_field(union): tag, **dict(zip(keys, fields))})
    return msgspec.msgpack.encode([tag, *fields])


@pytest.fixture
def inboxes(short_dir):
    ctx = zmq.Context()
    socks = {name: PullSocket(ctx, ipc_address(short_dir, name.replace(".", "_")), bind=True,
                              type=union) for name, union in INBOXES.items()}
    yield socks
    for sock in socks.values():
        sock.close()
    ctx.term()


@pytest.mark.parametrize("name", sorted(INBOXES))
def test_decoder_drops_random_bytes(inboxes, name):
    sock = inboxes[name]

    @SETTINGS
    @given(data=st.binary(max_size=200))
    def run(data):
        msg = sock.decode(data)  # never raises
        assert msg is None or isinstance(msg, INBOXES[name].__args__)

    run()


@pytest.mark.parametrize("name", sorted(INBOXES))
def test_decoder_drops_wrong_shapes_and_unknown_tags(inboxes, name):
    sock = inboxes[name]
    union = INBOXES[name]

    @SETTINGS
    @given(data=st.data())
    def run(data):
        msg = sock.decode(data.draw(wrong_shapes(union)))
        assert msg is None or isinstance(msg, union.__args__)

    run()
    assert sock.num_dropped > 0


def test_get_and_drain_skip_garbage(short_dir, caplog):
    ctx = zmq.Context()
    address = ipc_address(short_dir, "inbox")
    pull = PullSocket(ctx, address, bind=True, type=ToClusterManager)
    raw = ctx.socket(zmq.PUSH)  # a local process writing whatever it likes
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    up = TEUp(info=TEInfo(te_id="te0", model="m", address="ipc:///tmp/x"))
    garbage = [b"", b"\xc1", b"\x92\xa4TEUp\x01", msgspec.msgpack.encode(["Nope", 1]),
               msgspec.msgpack.encode({"type": "TEDown", "te_id": 5})]
    try:
        with caplog.at_level(logging.WARNING, logger=sockets.__name__):
            for frame in garbage:
                raw.send(frame)
            raw.send(msgspec.msgpack.encode(up))
            assert pull.get(timeout=5.0) == up
            for frame in garbage:
                raw.send(frame)
            raw.send_multipart([b"\x00", msgspec.msgpack.encode(up)])  # extra frames too
            deadline = time.monotonic() + 5.0
            got = []
            while not got and time.monotonic() < deadline:
                got = pull.drain()
                time.sleep(0.01)
            assert got == [up]
            with pytest.raises(TimeoutError):
                pull.get(timeout=0.05)
        assert pull.num_dropped == 2 * len(garbage) + 1
        # rate-limited: one line for the first burst, not one per frame
        dropped_lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
        assert 1 <= len(dropped_lines) < pull.num_dropped
    finally:
        raw.close(linger=0)
        pull.close()
        ctx.term()


def test_cluster_manager_survives_garbage(short_dir):
    from deepserve.control.cm.cluster_manager import ClusterManager
    ctx = zmq.Context()
    inbox, pub = ipc_address(short_dir, "cm"), ipc_address(short_dir, "cm_pub")
    cm = ClusterManager(ctx, inbox, pub, te_timeout_s=30.0)
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(inbox)
    up = TEUp(info=TEInfo(te_id="te0", model="m", address=ipc_address(short_dir, "te0")))
    try:
        for frame in [b"\xff" * 9, msgspec.msgpack.encode(["TEUp", "not-info"]),
                      msgspec.msgpack.encode(["Unknown"]), msgspec.msgpack.encode({})]:
            raw.send(frame)
        raw.send(msgspec.msgpack.encode(up))
        deadline = time.monotonic() + 5.0
        while "te0" not in cm.tes and time.monotonic() < deadline:
            cm.step(timeout=0.05)
        assert cm.tes == {"te0": up.info}
        assert cm.inbox.num_dropped == 4
    finally:
        raw.close(linger=0)
        cm.close()
        ctx.term()


def test_job_executor_survives_garbage(short_dir, tiny_model):
    from deepserve.control.je.job_executor import JobExecutor
    from tests.control.je_rig import je_settings
    ctx = zmq.Context()
    inbox, cm_pub = ipc_address(short_dir, "je"), ipc_address(short_dir, "cm_pub")
    pub = PubSocket(ctx, cm_pub, bind=True)
    je = JobExecutor(ctx, je_settings(inbox, cm_pub, tiny_model))
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(inbox)
    try:
        for frame in [b"\x00garbage", msgspec.msgpack.encode(["SubmitRequest", 1, 2]),
                      msgspec.msgpack.encode(["NoSuchMessage", "x"])]:
            raw.send(frame)
        raw.send(msgspec.msgpack.encode(AbortRequest(request_id="nobody")))
        te_list = TEList(tes=[TEInfo(te_id="te0", model="m",
                                     address=ipc_address(short_dir, "te0"))])
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            pub.socket.send(b"\x93garbage-from-a-fake-cm")  # the SUB side drops it too
            pub.put(te_list)
            je.step(20)
            if je.inbox.num_dropped == 3 and "te0" in je.te_sockets:
                break
        assert je.inbox.num_dropped == 3
        assert je.cm.num_dropped >= 1
        assert "te0" in je.te_sockets  # the valid TE list after the garbage was applied
    finally:
        raw.close(linger=0)
        je.close()
        pub.close()
        ctx.term()
