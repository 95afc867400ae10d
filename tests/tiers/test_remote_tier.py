"""The remote tier over real sockets: two tier services (two "hosts") on
loopback tcp, peers learned from TierReports as the CM relays them. B's
lookup of blocks only A holds gets them (bytes equal), another tenant's salt
finds nothing, a TE whose recompute is faster than the link gets no fetch,
a peer that never answers costs a bounded wait, not a stall, and a peer's
request is bounded in size."""

import time

import msgspec
import numpy as np
import pytest
import zmq

from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket, free_port, ipc_address
from deepserve.messages.cache import FromTier, PeerBlocks, PeerGet, TierLookup, TierReport
from deepserve.tiers.remote_tier import CHUNK_BLOCKS, MAX_FETCH_BLOCKS, MAX_REQUEST_BYTES
from tests.tiers.test_tier_server import GEOM, NBYTES, write


@pytest.fixture
def hosts(tier_service, short_dir):
    yield from two_hosts(tier_service, short_dir, 64)


@pytest.fixture
def big_hosts(tier_service, short_dir):
    """Host pools that take two fetches of MAX_FETCH_BLOCKS and more."""
    yield from two_hosts(tier_service, short_dir, 2 * MAX_FETCH_BLOCKS + 64)


def two_hosts(tier_service, short_dir, host_blocks: int):
    ctx = zmq.Context()
    pub = f"tcp://127.0.0.1:{free_port()}"  # the CM's PUB, as it relays TierReports
    cm = PubSocket(ctx, pub)
    peers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    a, b = (tier_service(host_bytes=host_blocks * NBYTES, peer=p, cm_pub=pub) for p in peers)
    socks = {}
    for name, service in (("a", a), ("b", b)):
        reply = ipc_address(short_dir, f"me-{name}")
        socks[name] = (PushSocket(ctx, service.address, bind=False),
                       PullSocket(ctx, reply, bind=True, type=FromTier), reply)

    def relay(*extra: str) -> None:
        """Relay both services' reports (and `extra` peers) until both know them."""
        want = {*peers, *extra}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for peer in want:
                cm.put(TierReport(peer=peer))
            known = [set(s.call(lambda srv: srv.remote.peers)) | {s.settings.peer}
                     for s in (a, b)]
            if all(k >= want for k in known):
                return
            time.sleep(0.05)
        raise AssertionError("peers not learned")

    yield a, b, socks, relay
    for out, back, _ in socks.values():
        out.close()
        back.close()
    cm.close()
    ctx.term()


def lookup(socks, name, hashes, **kw):
    out, back, reply = socks[name]
    out.put(TierLookup(lookup_id=7, model_key="m", geometry=GEOM, hashes=hashes, reply_to=reply,
                       **kw))
    return back.get(timeout=5)


def blocks(service, hits):
    pool = service.call(lambda s: s.pools["m"].slots.copy())
    return [pool[slot].tobytes() for slot in hits.slots]


def test_a_lookup_gets_the_blocks_another_host_holds(hosts):
    a, b, socks, relay = hosts
    hashes = list(range(1000, 1000 + CHUNK_BLOCKS + 8))  # two chunks
    write(a, *socks["a"], hashes)
    lookup(socks, "b", [1])  # b's pool for the model key (its first lookup makes it)
    relay()
    hits = lookup(socks, "b", hashes)
    assert len(hits.slots) == len(hashes) and min(hits.slots) >= 0  # all in b's host memory
    assert blocks(b, hits) == blocks(a, lookup(socks, "a", hashes))
    assert b.call(lambda s: s.report().num_remote_hits) == len(hashes)
    again = lookup(socks, "b", hashes)  # now b's own: nothing fetched again
    assert len(again.slots) == len(hashes)
    assert b.call(lambda s: s.remote.num_fetched) == len(hashes)
    # another tenant's salt: other hashes, held nowhere; nothing crosses tenants
    assert lookup(socks, "b", [h + 10**6 for h in hashes]).slots == []
    assert b.call(lambda s: s.remote.num_fetched) == len(hashes)


def test_no_fetch_when_recomputing_is_faster_than_the_link(hosts):
    a, b, socks, relay = hosts
    write(a, *socks["a"], [2000, 2001, 2002])
    lookup(socks, "b", [1])
    relay()
    assert lookup(socks, "b", [2000, 2001, 2002], prefill_tokens_per_s=1e15).slots == []
    assert b.call(lambda s: s.remote.num_fetched) == 0  # not asked at all
    slow = lookup(socks, "b", [2000, 2001, 2002], prefill_tokens_per_s=1.0)  # 4 s a block
    assert len(slow.slots) == 3


def test_a_peer_that_never_answers_costs_a_bounded_wait(hosts):
    a, b, socks, relay = hosts
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # takes every question, answers none
    address = f"tcp://127.0.0.1:{free_port()}"
    mute.bind(address)
    try:
        write(a, *socks["a"], [3000, 3001])
        lookup(socks, "b", [1])
        relay()
        b.call(lambda s: s.remote.peers.update({address: time.monotonic() + 60}))  # asked first
        started = time.monotonic()
        hits = lookup(socks, "b", [3000, 3001])
        elapsed = time.monotonic() - started
        remote = b.call(lambda s: s.remote)
        assert mute.poll(0, zmq.POLLIN)  # the mute peer was asked (and never answered)
        assert remote.timeout_s <= elapsed < remote.budget_s + 0.5, elapsed
        assert len(hits.slots) == 2  # then a, within the budget
        assert np.array_equal(blocks(b, hits), blocks(a, lookup(socks, "a", [3000, 3001])))
    finally:
        mute.close(linger=0)
        ctx.term()


def test_a_peer_request_is_bounded_and_garbage_gets_nothing(hosts):
    """A request of MAX_REQUEST_BYTES that does not decode: 0 blocks; one byte
    more: the connection drops, no answer; the service serves on."""
    a, b, socks, relay = hosts
    write(a, *socks["a"], [4000])
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(a.settings.peer)
        dealer.send(b"x" * MAX_REQUEST_BYTES)
        assert dealer.poll(3000)
        header, data = dealer.recv_multipart()
        assert msgspec.msgpack.decode(header, type=PeerBlocks).num_blocks == 0 and data == b""
        dealer.send(b"x" * (MAX_REQUEST_BYTES + 1))
        assert not dealer.poll(500)  # dropped
    finally:
        dealer.close(linger=0)
        ctx.term()
    lookup(socks, "b", [1])
    relay()
    assert len(lookup(socks, "b", [4000]).slots) == 1  # a serves b as before


def test_peers_expire_and_waiting_lookups_are_bounded_at_their_limits(short_dir):
    """A peer heard PEER_TTL_S ago is kept, a hair later forgotten; the
    MAX_WAITING-th waiting lookup is still sent to the peers, the next is not."""
    from deepserve.tiers.remote_tier import MAX_WAITING, PEER_TTL_S, RemoteTier
    ctx = zmq.Context()
    remote = RemoteTier(ctx, f"tcp://127.0.0.1:{free_port()}", ipc_address(short_dir, "pub"))
    try:
        remote.peers = {"tcp://peer:7407": 100.0}
        remote.learn(100.0 + PEER_TTL_S)
        assert list(remote.peers) == ["tcp://peer:7407"]
        ask = TierLookup(lookup_id=1, model_key="m", geometry=GEOM, hashes=[1], reply_to="x")
        remote.num_waiting = MAX_WAITING - 1
        assert remote.worth_fetching(ask, 1, NBYTES)
        remote.num_waiting = MAX_WAITING
        assert not remote.worth_fetching(ask, 1, NBYTES)
        remote.learn(100.0 + PEER_TTL_S + 0.01)
        assert remote.peers == {}
    finally:
        remote.close()
        ctx.term()


def test_a_fetch_takes_at_most_max_fetch_blocks(big_hosts):
    """A lookup missing MAX_FETCH_BLOCKS blocks that a peer holds gets them
    all; one missing a block more gets MAX_FETCH_BLOCKS (the TE computes the rest)."""
    a, b, socks, relay = big_hosts
    exact = list(range(10_000, 10_000 + MAX_FETCH_BLOCKS))
    over = list(range(20_000, 20_000 + MAX_FETCH_BLOCKS + 1))
    write(a, *socks["a"], exact + over)
    lookup(socks, "b", [1])
    relay()
    b.call(lambda s: setattr(s.remote, "budget_s", 30.0))  # the size binds, not the clock
    assert len(lookup(socks, "b", exact).slots) == MAX_FETCH_BLOCKS
    assert b.call(lambda s: s.remote.num_fetched) == MAX_FETCH_BLOCKS
    hits = lookup(socks, "b", over)
    assert len(hits.slots) == MAX_FETCH_BLOCKS
    assert b.call(lambda s: s.remote.num_fetched) == 2 * MAX_FETCH_BLOCKS
    assert blocks(b, hits) == blocks(a, lookup(socks, "a", over[:MAX_FETCH_BLOCKS]))


def test_a_peer_answers_at_most_one_chunk(hosts):
    """A PeerGet of CHUNK_BLOCKS held blocks gets them all; one of a block
    more gets CHUNK_BLOCKS, with exactly their bytes."""
    a, b, socks, relay = hosts
    hashes = list(range(30_000, 30_000 + CHUNK_BLOCKS + 1))
    write(a, *socks["a"], hashes)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(a.settings.peer)
        for ask in (hashes[:CHUNK_BLOCKS], hashes):
            dealer.send(msgspec.msgpack.encode(PeerGet(model_key="m", geometry=GEOM,
                                                       hashes=ask)))
            assert dealer.poll(3000)
            header, data = dealer.recv_multipart()
            assert msgspec.msgpack.decode(header, type=PeerBlocks).num_blocks == CHUNK_BLOCKS
            assert len(data) == CHUNK_BLOCKS * NBYTES
    finally:
        dealer.close(linger=0)
        ctx.term()
