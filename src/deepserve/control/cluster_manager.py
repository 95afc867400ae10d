"""Cluster manager: the registry of TEs, and the TE-list broadcast.

    TE servers ──TEUp / TEDown──┐
    TE masters ──TEReport───────┴─> [inbox PULL] ──> registry ──> [PUB] TEList, TEReport ──> JEs, gateways

A TE is listed from TEUp until TEDown, or until it has sent no report for
te_timeout_s (it hung or vanished). The TE list is published on every change
and re-published every second, so a subscriber that joined late (ZeroMQ
drops PUB messages sent before a SUB connects) catches up.

First publish of an incarnation: a CM that starts (or restarts under load)
knows no TE yet; the TEs re-announce themselves every TEUP_INTERVAL_S
(engine/te_server.py). Publishing at once would hand the JE an empty or
partial list, and the JE fails every task of a TE that is not listed. So an
incarnation publishes nothing until every TE of the node's config has
announced itself, or FIRST_PUBLISH_GRACE_S (1.5 TEUp intervals) after its
start, whichever comes first: by then every live TE has re-announced. Every
TEList names the incarnation (cm_incarnation) and says is_complete. Reports
are relayed meanwhile (their `finished` ids end the JE's tasks).

A TE that went down stays down for REUP_FENCE_S: a TEUp that arrives that
soon after its TEDown is stale (a dying TE's host may announce itself once
more before it notices a dead process), and no TE restarts that fast
(respawn delay, start, load, warm-up). Without the fence the TE would flap
back into the list and the JE route resumed requests to a dead TE.

`python -m deepserve.control.cluster_manager --conf RUN_DIR/node.json --role
cluster-manager`: its sockets are the run's (cm, cm_pub), te_timeout_s is [node]'s.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Collection

import msgspec
import zmq

from deepserve.actor import ActorLife
from deepserve.config.child import ChildArgs, parse_child_args, print_config
from deepserve.config.loading import read_run_config
from deepserve.ipc.sockets import PubSocket, PullSocket
from deepserve.messages.control import TEDown, TEInfo, TEList, TEReport, TEUp, ToClusterManager

log = logging.getLogger(__name__)
REPUBLISH_S = 1.0
TEUP_INTERVAL_S = 2.0
"""engine/te_server.py's TEUP_INTERVAL_S (a test checks they agree)."""
FIRST_PUBLISH_GRACE_S = 1.5 * TEUP_INTERVAL_S
"""An incarnation's longest silence before its first TE list."""
REUP_FENCE_S = 2.0
"""A TEUp this soon after the TE's TEDown is stale (module doc)."""


class ClusterManager:
    """expected_tes: the TE ids of the node's config (the grace ends when all
    announced); clock: time.monotonic (a test's fake); events: ActorLife.event."""

    def __init__(self, ctx: zmq.Context, inbox: str, pub: str, te_timeout_s: float,
                 grace_s: float = FIRST_PUBLISH_GRACE_S, expected_tes: Collection[str] = (),
                 clock: Callable[[], float] = time.monotonic, events=None):
        self.inbox = PullSocket(ctx, inbox, bind=True, type=ToClusterManager)
        self.pub = PubSocket(ctx, pub, bind=True)
        self.te_timeout_s = te_timeout_s
        self.clock = clock
        self.incarnation = uuid.uuid4().hex[:12]
        self.listing_at = clock() + grace_s  # no TEList before this (module doc)
        self.expected_tes = frozenset(expected_tes)
        self.events = events
        self.tes: dict[str, TEInfo] = {}
        self.last_seen: dict[str, float] = {}
        self.down_at: dict[str, float] = {}  # te id -> its last TEDown (the re-up fence)
        self.last_published: float | None = None

    @property
    def is_listing(self) -> bool:
        """This incarnation has heard from its TEs: it publishes TE lists."""
        if self.last_published is not None:
            return True
        return self.clock() >= self.listing_at or (
            bool(self.expected_tes) and self.expected_tes <= set(self.tes))

    def step(self, timeout: float = 0.2) -> None:
        try:
            self.handle(self.inbox.get(timeout=timeout))
        except TimeoutError:
            pass
        self._expire()
        if self.last_published is None or self.clock() - self.last_published > REPUBLISH_S:
            self.publish()

    def handle(self, msg) -> None:
        now = self.clock()
        if isinstance(msg, TEUp):  # TEs repeat it, so a restarted CM relearns them
            te_id = msg.info.te_id
            if now - self.down_at.get(te_id, -REUP_FENCE_S) < REUP_FENCE_S:
                log.info("TE %s: TEUp %.3f s after its TEDown ignored (stale)", te_id,
                         now - self.down_at[te_id])
                return
            self.last_seen[te_id] = now
            if self.tes.get(te_id) != msg.info:
                self.tes[te_id] = msg.info
                log.warning("TE %s up at %s", te_id, msg.info.address)
                self.publish()
        elif isinstance(msg, TEDown):
            self.down_at[msg.te_id] = now
            self._remove(msg.te_id, msg.reason)
        elif isinstance(msg, TEReport) and (msg.te_id in self.tes or not self.is_listing):
            if msg.te_id in self.tes:
                self.last_seen[msg.te_id] = now
            self.pub.put(msg)

    def _expire(self) -> None:
        now = self.clock()
        for te_id, seen in list(self.last_seen.items()):
            if now - seen > self.te_timeout_s:
                self._remove(te_id, f"no report for {self.te_timeout_s} s")

    def _remove(self, te_id: str, reason: str) -> None:
        self.last_seen.pop(te_id, None)
        if self.tes.pop(te_id, None) is not None:
            log.warning("TE %s down: %s", te_id, reason)
            self.publish()

    def publish(self) -> None:
        """Send the TE list, unless this incarnation has not heard from its TEs yet."""
        if not self.is_listing:
            return
        if self.last_published is None:
            log.warning("cluster manager %s: first TE list, %d TE(s)", self.incarnation,
                        len(self.tes))
            if self.events is not None:
                self.events("te_list_complete", incarnation=self.incarnation,
                            num_tes=len(self.tes))
        self.pub.put(TEList(tes=list(self.tes.values()), cm_incarnation=self.incarnation))
        self.last_published = self.clock()

    def close(self) -> None:
        self.inbox.close()
        self.pub.close()


class CMSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the cluster manager takes from the node's resolved config."""

    inbox: str
    pub: str
    te_timeout_s: float
    """[node] te_timeout_s."""
    te_ids: tuple[str, ...] = ()
    """The node's TEs (the first TE list waits for them, at most the grace)."""


def load_settings(args: ChildArgs) -> CMSettings:
    config, run = read_run_config(args.conf)
    return CMSettings(inbox=run.cm, pub=run.cm_pub, te_timeout_s=config.node.te_timeout_s,
                      te_ids=tuple(te.te_id for te in config.tes))


def main(argv: list[str] | None = None) -> None:
    args = parse_child_args(argv, "cluster-manager", "DeepServe cluster manager")
    settings = load_settings(args)
    if args.print_config:
        return print_config(settings)
    life = ActorLife("cluster-manager", parent_pid=args.parent_pid)
    ctx = zmq.Context()
    cm = ClusterManager(ctx, settings.inbox, settings.pub, settings.te_timeout_s,
                        expected_tes=settings.te_ids, events=life.event)
    try:
        life.ready()
        life.run(cm.step, lambda: {"tes": len(cm.tes)})
    finally:
        cm.close()
        ctx.term()
        life.close()


if __name__ == "__main__":
    main()
