"""Cluster manager: the registry of TEs, and the TE-list broadcast.

    TE servers ──TEUp / TEDown──┐
    TE masters ──TEReport───────┴─> [inbox PULL] ──> registry ──> [PUB] TEList, TEReport ──> JEs, gateways

A TE is listed from TEUp until TEDown, or until it has sent no report for
te_timeout_s (it hung or vanished). The TE list is published on every change
and re-published every second, so a subscriber that joined late (ZeroMQ
drops PUB messages sent before a SUB connects) catches up.

First publish of an incarnation: a CM that starts (or restarts under load)
knows no TE yet; the TEs re-announce themselves every TEUP_INTERVAL_S
(messages/control.py). Publishing at once would hand the JE an empty or
partial list, and the JE fails every task of a TE that is not listed. So an
incarnation publishes no list of TEs until every TE of the node's config has
announced itself, or FIRST_PUBLISH_GRACE_S (1.5 TEUp intervals) after its
start, whichever comes first: by then every live TE has re-announced. Every
TEList names the incarnation (cm_incarnation) and says is_complete; until
then the CM sends an empty one with is_complete = False every second, which
readers ignore but a standby head hears (supervisor/head_watch.py). Reports
are relayed meanwhile (their `finished` ids end the JE's tasks).

A TE that went down stays down for REUP_FENCE_S: a TEUp that arrives that
soon after its TEDown is stale (a dying TE's host may announce itself once
more before it notices a dead process), and no TE restarts that fast
(respawn delay, start, load, warm-up). Without the fence the TE would flap
back into the list and the JE route resumed requests to a dead TE. A TEUp
naming another incarnation (TEInfo.incarnation: a pre-warmed process can
replace a TE in well under REUP_FENCE_S) is the new TE, and passes.

`python -m deepserve.control.cm.cluster_manager --conf RUN_DIR/node.json --role
cluster-manager`: its sockets are the run's (cm, cm_pub), te_timeout_s is [node]'s.

Scaling (scaling.py): with scalable models the CM runs the autoscaler each
step; a TE it drains for scale-in stays listed with draining = True (a TEUp
does not undo that) until its TEDown.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Collection

import msgspec.structs

import msgspec
import zmq

from deepserve.actor import ActorLife, run_main
from deepserve.config.child import ChildArgs
from deepserve.config.loading import read_run_config
from deepserve.config.models import ModelSpec, ScalingSection
from deepserve.control.cm.hosts import HostBook
from deepserve.control.cm.scaling import ScalingControl, options_of, policies_of, targets_of
from deepserve.control.identity import cm_admit
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket
from deepserve.messages.cache import TierReport
from deepserve.messages.control import (TEUP_INTERVAL_S, TEDown, TEInfo, TEList, TEReport, TEUp,
                                        ToClusterManager)
from deepserve.messages.scaling import ModelDemand, NodeReport, ScaleEvent, ScaleOut

log = logging.getLogger(__name__)
REPUBLISH_S = 1.0
FIRST_PUBLISH_GRACE_S = 1.5 * TEUP_INTERVAL_S
"""An incarnation's longest silence before its first TE list."""
REUP_FENCE_S = 2.0
"""A TEUp this soon after the TE's TEDown is stale (module doc)."""


class ClusterManager:
    """expected_tes: the TE ids of the node's config (the grace ends when all
    announced); clock: time.monotonic (a test's fake); events: ActorLife.event."""

    def __init__(self, ctx: zmq.Context, inbox: str, pub: str, te_timeout_s: float,
                 grace_s: float = FIRST_PUBLISH_GRACE_S, expected_tes: Collection[str] = (),
                 clock: Callable[[], float] = time.monotonic, events=None, term: int = 0):
        self.inbox = PullSocket(ctx, inbox, bind=True, type=ToClusterManager, admit=cm_admit)
        self.term = term  # this head's term (TEList.term)
        self.deposed_by: int | None = None  # a higher term a node reported: stepped down
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
        self.down_parts: dict[str, str] = {}  # te id -> the part it went down with (TEList)
        self.down_incarnation: dict[str, str] = {}  # te id -> the incarnation that went
        self.last_published: float | None = None
        self.beacon_at = -REPUBLISH_S  # the last incomplete list (publish)
        self.conflicts: set[tuple[str, str]] = set()  # (te id, address) refused (logged once)
        self.scaling: ScalingControl | None = None  # enable_scaling
        self.outboxes: tuple = ()  # the scaling's sockets (to the nodes), closed here
        self._handlers = {TEUp: self._on_te_up, TEDown: self._on_te_down,
                          TEReport: self._on_report, ModelDemand: self._on_demand,
                          ScaleEvent: self._on_scale_event, NodeReport: self._on_node_report,
                          TierReport: self.pub.put}  # the KV tiers' state, for /metrics

    def enable_scaling(self, control: ScalingControl, *outboxes) -> None:
        """Run the autoscaler; outboxes: what its orders leave by (closed by close())."""
        self.scaling, self.outboxes = control, outboxes

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
            for msg in self.inbox.drain():
                self.handle(msg)
        except TimeoutError:
            pass
        if self.deposed_by is not None:  # silent until its supervisor stops it
            return
        self._expire()
        if self.scaling is not None and self.is_listing:
            for te_id in self.scaling.step(self.clock(), self.tes):
                self.tes[te_id] = msgspec.structs.replace(self.tes[te_id], draining=True)
                log.warning("TE %s drains for scale-in", te_id)
                self.publish()
        if self.last_published is None or self.clock() - self.last_published > REPUBLISH_S:
            self.publish()

    def handle(self, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _on_te_up(self, msg: TEUp) -> None:
        """TEs repeat it, so a restarted CM relearns them."""
        now, te_id = self.clock(), msg.info.te_id
        gone = self.down_incarnation.get(te_id, "")
        is_new = bool(msg.info.incarnation) and bool(gone) and msg.info.incarnation != gone
        if not is_new and now - self.down_at.get(te_id, -REUP_FENCE_S) < REUP_FENCE_S:
            log.info("TE %s: TEUp %.3f s after its TEDown ignored (stale)", te_id,
                     now - self.down_at[te_id])
            return
        if self._conflicts(msg.info, now):
            return
        self.last_seen[te_id] = now
        if self.scaling is not None:
            if self.scaling.is_held(te_id) and te_id in self.tes:
                return  # draining: it stays marked so
            self.scaling.on_te_up(msg.info, now)
        if self.tes.get(te_id) != msg.info:
            self.tes[te_id] = msg.info
            log.warning("TE %s up at %s", te_id, msg.info.address)
            self.publish()

    def _on_te_down(self, msg: TEDown) -> None:
        listed = self.tes.get(msg.te_id)
        if msg.address and listed is not None and listed.address != msg.address:
            log.error("TE %s: TEDown from %s ignored: the listed TE of that id is at %s",
                      msg.te_id, msg.address, listed.address)
            return
        self.down_at[msg.te_id] = self.clock()
        self._remove(msg.te_id, msg.reason, msg.part)

    def _on_report(self, msg: TEReport) -> None:
        """Relayed from a listed TE, or from any while no TE list is out yet."""
        if msg.te_id in self.tes:
            now = self.clock()
            self.last_seen[msg.te_id] = now
            if self.scaling is not None:
                self.scaling.on_report(msg, self.tes[msg.te_id].model, now)
        elif self.is_listing:
            return
        self.pub.put(msg)

    def _on_demand(self, msg: ModelDemand) -> None:
        if self.scaling is not None:
            self.scaling.on_demand(msg, self.clock())

    def _on_node_report(self, msg: NodeReport) -> None:
        if msg.term > self.term and self.deposed_by is None:
            self._step_down(msg.term, msg.node)
        if self.scaling is not None and self.deposed_by is None:
            self.scaling.on_node_report(msg, self.clock())

    def _step_down(self, term: int, node: str) -> None:
        """Another head took a higher term (a standby that took over while this
        head was cut off from it): publish, place and scale nothing more; the
        node's supervisor stops this CM and the JE (head_stepped_down)."""
        self.deposed_by = term
        log.error("cluster manager of term %d: node %s heard term %d; stepping down",
                  self.term, node, term)
        if self.events is not None:
            self.events("head_stepped_down", term=self.term, new_term=term, heard_from=node)

    def _on_scale_event(self, msg: ScaleEvent) -> None:
        if self.scaling is not None:
            self.scaling.on_scale_event(msg)
        self.pub.put(msg)  # gateways count it (/metrics)

    def _conflicts(self, info: TEInfo, now: float) -> bool:
        """A second TE claims a listed TE's id from another address (two nodes
        of one name, a copied config) while the listed one still reports: the
        newcomer is refused, loudly, once per address; the listed TE keeps its id."""
        listed = self.tes.get(info.te_id)
        if listed is None or listed.address == info.address \
                or now - self.last_seen.get(info.te_id, -float("inf")) > self.te_timeout_s:
            return False
        if (info.te_id, info.address) not in self.conflicts:
            self.conflicts.add((info.te_id, info.address))
            log.error("TE id %s claimed from %s while the TE at %s holds it: refused (give "
                      "each node its own [cluster] name)", info.te_id, info.address,
                      listed.address)
            if self.events is not None:
                self.events("te_id_conflict", te_id=info.te_id, address=info.address,
                            listed_address=listed.address)
        return True

    def _expire(self) -> None:
        now = self.clock()
        for te_id, seen in list(self.last_seen.items()):
            if now - seen > self.te_timeout_s:
                self._remove(te_id, f"no report for {self.te_timeout_s} s")

    def _remove(self, te_id: str, reason: str, part: str = "") -> None:
        self.last_seen.pop(te_id, None)
        info = self.tes.get(te_id)
        if info is not None:
            self.down_parts[te_id] = part  # the first word on it (another TEDown is late)
            self.down_incarnation[te_id] = info.incarnation
        if info is not None and self.scaling is not None:
            self.scaling.on_te_down(te_id, info.model, reason, self.clock())
        if self.tes.pop(te_id, None) is not None:
            log.warning("TE %s down: %s", te_id, reason)
            if self.events is not None:  # a whole host gone shows as its TEs, all at once
                self.events("te_removed", te_id=te_id, reason=reason)
            self.publish()

    def publish(self) -> None:
        """Send the TE list; before this incarnation has heard from its TEs, an
        empty incomplete one instead, at most every REPUBLISH_S: a sign of life
        (every reader ignores its contents; a standby head counts the head alive
        by it, so a CM restarting on a live head is no reason to take over)."""
        if not self.is_listing:
            if self.clock() - self.beacon_at >= REPUBLISH_S:
                self.pub.put(TEList(tes=[], cm_incarnation=self.incarnation, is_complete=False,
                                    term=self.term))
                self.beacon_at = self.clock()
            return
        if self.last_published is None:
            log.warning("cluster manager %s: first TE list, %d TE(s)", self.incarnation,
                        len(self.tes))
            if self.events is not None:
                self.events("te_list_complete", incarnation=self.incarnation,
                            num_tes=len(self.tes))
        down = {te_id: part for te_id, part in self.down_parts.items() if te_id not in self.tes}
        self.down_parts = down
        self.pub.put(TEList(tes=list(self.tes.values()), cm_incarnation=self.incarnation,
                            down=down, term=self.term))
        self.last_published = self.clock()

    def close(self) -> None:
        self.inbox.close()
        self.pub.close()
        for outbox in self.outboxes:
            outbox.close()


class CMSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the cluster manager takes from the node's resolved config."""

    inbox: str
    pub: str
    te_timeout_s: float
    """[node] te_timeout_s."""
    te_ids: tuple[str, ...] = ()
    """The node's TEs (the first TE list waits for them, at most the grace)."""
    supervisor: str = ""
    """The CM's own node's supervisor inbox (ScaleOut / ScaleIn before any
    node reports; other nodes' come in their NodeReports)."""
    models: tuple[ModelSpec, ...] = ()
    """Scalable models ([[model]]): the autoscaler's; none: no autoscaler."""
    scaling: ScalingSection = ScalingSection()
    initial: dict[str, str] = {}
    """TE id -> model of the scaled TEs the node starts itself (min_tes)."""
    startup_timeout_s: float = 180.0
    term: int = 0
    """The node's head term (NodeConfig.term)."""
    places: bool = False
    """A head of many hosts: nodes report, and a lost one's TEs start on the
    others (scaling.py), with or without scalable models."""


def load_settings(args: ChildArgs) -> CMSettings:
    config, run = read_run_config(args.conf)
    initial = config.initial_scaled_tes()
    return CMSettings(inbox=run.cm, pub=run.cm_pub, te_timeout_s=config.node.te_timeout_s,
                      te_ids=tuple(te.te_id for te in config.tes) + tuple(initial),
                      supervisor=run.hb, models=tuple(m for m in config.models if m.scalable),
                      scaling=config.scaling, initial=initial,
                      startup_timeout_s=config.node.startup_timeout_s,
                      places=config.cluster.is_cluster, term=config.term)


def build(ctx: zmq.Context, settings: CMSettings, life: ActorLife) -> ClusterManager:
    """The CM of a node; with scalable models (or as the head of many hosts:
    a lost node's TEs are replaced) its autoscaler and placement, whose orders
    go to its own node's supervisor (a PUSH socket) or to the node placement
    picks (one PUSH per node address); the CM closes both."""
    cm = ClusterManager(ctx, settings.inbox, settings.pub, settings.te_timeout_s,
                        expected_tes=settings.te_ids, events=life.event, term=settings.term)
    if settings.models or settings.places:
        to_supervisor = PushSocket(ctx, settings.supervisor, bind=False)
        to_nodes = Outboxes(ctx, timeout_s=0.5)

        def send(msg) -> None:
            try:  # every order names its head's term (a deposed head's are dropped)
                to_supervisor.put(msgspec.structs.replace(msg, term=settings.term), timeout=0.5)
            except TimeoutError:
                log.error("%s not sent: the supervisor does not listen", type(msg).__name__)

        def send_to(address: str, msg) -> None:
            if address == settings.supervisor:
                return send(msg)
            if isinstance(msg, ScaleOut):  # another host's clock: timed from its arrival
                msg = msgspec.structs.replace(msg, decided_at=0.0)
            msg = msgspec.structs.replace(msg, term=settings.term)
            if not to_nodes.put(address, msg):
                log.error("%s not sent: the node at %s does not listen", type(msg).__name__,
                          address)
                return False
            return True
        cm.enable_scaling(ScalingControl(
            policies_of(settings.models), options_of(settings.scaling), send, life.event,
            time.monotonic(), settings.startup_timeout_s, settings.initial,
            hosts=HostBook(settings.te_timeout_s, local=settings.supervisor), send_to=send_to,
            targets=targets_of(settings.models)), to_supervisor, to_nodes)
    return cm


def main(argv: list[str] | None = None) -> None:
    run_main("cluster-manager", "DeepServe cluster manager", argv, load_settings, build,
             lambda cm: {"tes": len(cm.tes)})


if __name__ == "__main__":
    main()
