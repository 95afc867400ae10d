"""Cluster manager: the registry of TEs, and the TE-list broadcast.

    TE servers ──TEUp / TEDown──┐
    TE masters ──TEReport───────┴─> [inbox PULL] ──> registry ──> [PUB] TEList, TEReport ──> JEs, gateways

A TE is listed from TEUp until TEDown, or until it has sent no report for
te_timeout_s (it hung or vanished). The TE list is published on every change
and re-published every second, so a subscriber that joined late (ZeroMQ
drops PUB messages sent before a SUB connects) catches up.

`python -m deepserve.control.cluster_manager --conf RUN_DIR/node.json --role
cluster-manager`: its sockets are the run's (cm, cm_pub), te_timeout_s is [node]'s.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from deepserve.actor import ActorLife
from deepserve.config.child import ChildArgs, parse_child_args, print_config
from deepserve.config.loading import read_run_config
from deepserve.ipc.sockets import PubSocket, PullSocket
from deepserve.messages.control import TEDown, TEInfo, TEList, TEReport, TEUp, ToClusterManager

log = logging.getLogger(__name__)
REPUBLISH_S = 1.0


class ClusterManager:
    def __init__(self, ctx: zmq.Context, inbox: str, pub: str, te_timeout_s: float):
        self.inbox = PullSocket(ctx, inbox, bind=True, type=ToClusterManager)
        self.pub = PubSocket(ctx, pub, bind=True)
        self.te_timeout_s = te_timeout_s
        self.tes: dict[str, TEInfo] = {}
        self.last_seen: dict[str, float] = {}
        self.last_published = 0.0

    def step(self, timeout: float = 0.2) -> None:
        try:
            self.handle(self.inbox.get(timeout=timeout))
        except TimeoutError:
            pass
        self._expire()
        if time.monotonic() - self.last_published > REPUBLISH_S:
            self.publish()

    def handle(self, msg) -> None:
        if isinstance(msg, TEUp):  # TEs repeat it, so a restarted CM relearns them
            self.last_seen[msg.info.te_id] = time.monotonic()
            if self.tes.get(msg.info.te_id) != msg.info:
                self.tes[msg.info.te_id] = msg.info
                log.warning("TE %s up at %s", msg.info.te_id, msg.info.address)
                self.publish()
        elif isinstance(msg, TEDown):
            self._remove(msg.te_id, msg.reason)
        elif isinstance(msg, TEReport) and msg.te_id in self.tes:
            self.last_seen[msg.te_id] = time.monotonic()
            self.pub.put(msg)

    def _expire(self) -> None:
        now = time.monotonic()
        for te_id, seen in list(self.last_seen.items()):
            if now - seen > self.te_timeout_s:
                self._remove(te_id, f"no report for {self.te_timeout_s} s")

    def _remove(self, te_id: str, reason: str) -> None:
        if self.tes.pop(te_id, None) is not None:
            self.last_seen.pop(te_id, None)
            log.warning("TE %s down: %s", te_id, reason)
            self.publish()

    def publish(self) -> None:
        self.pub.put(TEList(tes=list(self.tes.values())))
        self.last_published = time.monotonic()

    def close(self) -> None:
        self.inbox.close()
        self.pub.close()


class CMSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the cluster manager takes from the node's resolved config."""

    inbox: str
    pub: str
    te_timeout_s: float
    """[node] te_timeout_s."""


def load_settings(args: ChildArgs) -> CMSettings:
    config, run = read_run_config(args.conf)
    return CMSettings(inbox=run.cm, pub=run.cm_pub, te_timeout_s=config.node.te_timeout_s)


def main(argv: list[str] | None = None) -> None:
    args = parse_child_args(argv, "cluster-manager", "DeepServe cluster manager")
    settings = load_settings(args)
    if args.print_config:
        return print_config(settings)
    life = ActorLife("cluster-manager", parent_pid=args.parent_pid)
    ctx = zmq.Context()
    cm = ClusterManager(ctx, settings.inbox, settings.pub, settings.te_timeout_s)
    try:
        life.ready()
        life.run(cm.step, lambda: {"tes": len(cm.tes)})
    finally:
        cm.close()
        ctx.term()
        life.close()


if __name__ == "__main__":
    main()
