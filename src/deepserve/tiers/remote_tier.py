"""The remote tier: KV blocks other hosts' tier services hold, fetched over tcp.

    every tier service ──TierReport(peer = its tcp address)──> CM ──PUB──> every tier service
        └─ RemoteTier.learn(): the peers heard from within PEER_TTL_S (not itself)

    a TE's TierLookup, the local run shorter than asked ──worth_fetching?──> fetch(job)
        fetcher thread: PeerGet(the missing hashes, CHUNK_BLOCKS at a time) ──> a peer's ROUTER
                        <── PeerBlocks(n) + n blocks' bytes (its host tier's leading run)
        finished() ──> the tier service writes them into its host pool and answers
                       the lookup as if they had been here (tier_server.py)

    other hosts' PeerGet ──> this service's ROUTER ──serve(read)──> its host tier's bytes

Fetch or recompute (the RTC cost model, tiers/cost_model.py): fetching n
blocks over the link costs latency + n * block_bytes / bandwidth, with the
link's bandwidth measured on every fetch (exponentially weighted; the
latency a fixed round trip, LINK_LATENCY_S);
recomputing them costs n * block_size / the TE's measured prefill speed
(TierLookup.prefill_tokens_per_s). A lookup is sent to the peers only when
fetching is the cheaper; a TE that does not know its speed (0) always asks.

Blocks are named by their salted chained hash (cache/block_hash.py), so a
tenant's lookup can only match the blocks of its own salt, on every host as
on every tier. Only host-memory blocks are served (a peer's disk is its own
storage bandwidth, DualPath's concern). A peer that does not answer within
timeout_s is skipped for that fetch (its socket is dropped: a late answer
never meets the next question); the whole fetch stays within fetch_budget_s,
under the TE's own lookup deadline (engine/tiers/channel.py), so a slow link
costs a miss, never a stall. With [cluster] secure the sockets run CURVE.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import numpy as np
import zmq

from deepserve.ipc import curve
from deepserve.ipc.sockets import SubSocket
from deepserve.messages.cache import (NO_SLOT, ON_DISK, PeerBlocks, PeerGet, TierLookup,
                                      TierReport)
from deepserve.messages.control import FromClusterManager
from deepserve.tiers.cost_model import TierSpeed

log = logging.getLogger(__name__)
CHUNK_BLOCKS = 32
"""Blocks one PeerGet asks for (and a server sends) at most."""
MAX_FETCH_BLOCKS = 1024
"""Blocks one lookup fetches at most."""
PEER_TTL_S = 5.0
"""A peer not heard of (its TierReport relayed) for this long is forgotten."""
MAX_REQUEST_BYTES = 1 << 20
"""A peer's request larger than this is a protocol error: its connection drops."""
LINK_LATENCY_S = 2e-3
"""A fetch's cost beyond its bytes (one round trip, and the chunks' own)."""
MAX_WAITING = 64
"""Lookups waiting for a fetch at most; past it a lookup is answered at once."""


@dataclass
class Fetch:
    """One lookup's missing blocks: hashes[start:] asked; the first `count` came."""

    lookup: TierLookup
    start: int
    block_bytes: int
    peer: str = ""
    count: int = 0
    data: bytes = b""
    seconds: float = 0.0
    asked_at: float = field(default_factory=time.monotonic)


class RemoteTier:
    """bind: this service's tcp address for peers; cm_pub: the CM's PUB (the
    peers' TierReports); the fetcher thread has sockets of its own."""

    def __init__(self, ctx: zmq.Context, bind: str, cm_pub: str, timeout_s: float = 0.3,
                 fetch_budget_s: float = 0.6):
        self.address, self.timeout_s, self.budget_s = bind, timeout_s, fetch_budget_s
        self.server = ctx.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 0)
        self.server.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # a PeerGet is small
        curve.secure(self.server, bind, True)
        self.server.bind(bind)
        self.reports = SubSocket(ctx, cm_pub, bind=False, type=FromClusterManager)
        self.peers: dict[str, float] = {}  # address -> when last heard of
        self.link = TierSpeed(bandwidth=1e9, latency=LINK_LATENCY_S)  # bandwidth: measured
        self.num_fetched = self.num_served = 0  # blocks
        self._ctx = ctx
        self._encoder = msgspec.msgpack.Encoder()
        self._get = msgspec.msgpack.Decoder(PeerGet)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.num_waiting = 0
        self._thread = threading.Thread(target=self._fetch_loop, name="remote-tier", daemon=True)
        self._thread.start()

    # -- main loop side ----------------------------------------------------------------
    def learn(self, now: float) -> None:
        for msg in self.reports.drain():
            if isinstance(msg, TierReport) and msg.peer and msg.peer != self.address:
                self.peers[msg.peer] = now
        for peer, seen in list(self.peers.items()):
            if now - seen > PEER_TTL_S:
                del self.peers[peer]

    def worth_fetching(self, lookup: TierLookup, num_missing: int, block_bytes: int) -> bool:
        """Ask the peers for num_missing blocks: someone to ask, room to wait,
        and the link beats recomputing them (module doc)."""
        if not self.peers or num_missing <= 0 or self.num_waiting >= MAX_WAITING:
            return False
        tps = lookup.prefill_tokens_per_s
        if tps <= 0:
            return True
        fetch_s = self.link.seconds(num_missing * block_bytes)
        return fetch_s < num_missing * lookup.geometry.block_size / tps

    def fetch(self, job: Fetch) -> None:
        self.num_waiting += 1
        self._jobs.put((job, sorted(self.peers, key=self.peers.get, reverse=True)))

    def finished(self) -> list[Fetch]:
        """Fetches done (with blocks or without), for the main loop to apply."""
        out = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return out
            self.num_waiting -= 1
            self.num_fetched += job.count
            if job.count and job.seconds > 0:
                self._observe(len(job.data), job.seconds)
            out.append(job)

    def serve(self, read: Callable[[PeerGet], tuple[int, bytes | np.ndarray]],
              limit: int = 8) -> None:
        """Answer up to `limit` waiting PeerGets with read(msg): (number of leading
        blocks held, their bytes). A request that does not decode gets 0 blocks."""
        for _ in range(limit):
            if not self.server.poll(0, zmq.POLLIN):
                return
            frames = self.server.recv_multipart()
            if len(frames) != 2:
                continue  # not a DEALER's one-frame request: nothing to answer
            ident, payload = frames
            try:
                msg = self._get.decode(payload)
                n, data = read(msgspec.structs.replace(msg, hashes=msg.hashes[:CHUNK_BLOCKS]))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
                n, data = 0, b""
            self.num_served += n
            self.server.send_multipart([ident, self._encoder.encode(PeerBlocks(num_blocks=n)),
                                        data], copy=False)

    def _observe(self, nbytes: int, seconds: float, alpha: float = 0.3) -> None:
        """The link's bandwidth from a fetch (its chunks' round trips count as latency)."""
        bandwidth = nbytes / max(seconds - self.link.latency, 1e-6)
        self.link.bandwidth += alpha * (bandwidth - self.link.bandwidth)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)
        self.server.close(linger=0)
        self.reports.close()

    # -- the fetcher thread ------------------------------------------------------------
    def _fetch_loop(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        codec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(PeerBlocks)  # this thread's
        try:
            while True:
                item = self._jobs.get()
                if item is None:
                    return
                job, peers = item
                try:
                    self._fetch(job, peers, sockets, codec)
                except Exception:  # a bug: this lookup is answered without the peers
                    log.exception("remote tier fetch failed")
                self._done.put(job)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)

    def _fetch(self, job: Fetch, peers: list[str], sockets: dict, codec) -> None:
        """The leading run of the missing blocks from the first peer that has any."""
        hashes = job.lookup.hashes[job.start:job.start + MAX_FETCH_BLOCKS]
        deadline = job.asked_at + self.budget_s
        for peer in peers:
            chunks, started = [], time.monotonic()
            while len(chunks) * CHUNK_BLOCKS < len(hashes) and time.monotonic() < deadline:
                ask = hashes[len(chunks) * CHUNK_BLOCKS:(len(chunks) + 1) * CHUNK_BLOCKS]
                got = self._ask(peer, PeerGet(model_key=job.lookup.model_key,
                                              geometry=job.lookup.geometry, hashes=ask),
                                sockets, codec, min(self.timeout_s, deadline - time.monotonic()),
                                job.block_bytes)
                if got is None:
                    break
                chunks.append(got)
                if len(got) < len(ask) * job.block_bytes:
                    break  # the peer's run ends here
            data = b"".join(chunks)
            if data:
                job.peer, job.data, job.count = peer, data, len(data) // job.block_bytes
                job.seconds = time.monotonic() - started
                return

    def _ask(self, peer: str, msg: PeerGet, sockets: dict, codec, timeout_s: float,
             block_bytes: int) -> bytes | None:
        """The bytes of the blocks `peer` sent for msg; None: no answer in time
        (its socket dropped) or an answer that does not add up."""
        if timeout_s <= 0:
            return None
        sock = sockets.get(peer)
        if sock is None:
            sock = sockets[peer] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            curve.secure(sock, peer, False)
            sock.connect(peer)
        encoder, decoder = codec
        sock.send(encoder.encode(msg))
        if not sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLIN):
            sockets.pop(peer).close(linger=0)
            return None
        frames = sock.recv_multipart()
        try:
            n = decoder.decode(frames[0]).num_blocks
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            return None
        data = frames[1] if len(frames) == 2 else b""
        if not 0 <= n <= len(msg.hashes) or len(data) != n * block_bytes:
            return None
        return data


# -- a host pool's side (tier_server.py: its TierIndex and slot array) ------------------
def read_run(index, slots: np.ndarray, hashes: list[int], now: float
             ) -> tuple[int, bytes | np.ndarray]:
    """The leading run of `hashes` in host memory, and their bytes: one copy
    out of the pool (the frame sent as it is), read under a lease released
    before this returns."""
    lease, found = index.lookup(hashes, now)
    run = []
    for slot in found:
        if slot == ON_DISK:
            break
        run.append(slot)
    data = slots[np.asarray(run, dtype=np.int64)] if run else b""
    index.release(lease)
    return len(run), data


def write_blocks(index, slots: np.ndarray, hashes: list[int], data: bytes,
                 now: float) -> list[tuple[int, int]]:
    """Another host's blocks into this host pool (those it does not hold and
    has room for); the (slot, hash) pairs to copy on to disk, as TierCommit's."""
    lease, reserved, _ = index.reserve(hashes, now)
    size = index.block_bytes
    for i, slot in enumerate(reserved):
        if slot != NO_SLOT:
            slots[slot][:] = np.frombuffer(data, np.uint8, size, i * size)
    return index.commit(lease, [slot for slot in reserved if slot != NO_SLOT])
