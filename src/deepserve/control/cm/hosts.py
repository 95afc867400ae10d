"""Cluster-wide placement: which node starts a scaled TE, and which nodes are lost.

    every node's supervisor ──NodeReport (every NODE_REPORT_S)──> HostBook.on_report
    ScalingControl ── choose(model, path, devices, size) ──> a node (or None: no room)
                   ── placed(node) after sending it a ScaleOut (held until it reports it)
                   ── expire(now) ──> nodes whose reports stopped (lost with their TEs)

Pure: no sockets or clock; every call carries `now`. A node is a candidate
for a model when it is alive (reported within timeout_s), has the devices
(free_devices minus its placements in flight; None: no limit) and memory
(available_bytes at least the model's weights). Among candidates the best is
the one, in this order:
1. holding the fewest TEs of the model (replicas spread over hosts: a lost
   host takes as few of a model's TEs as it can);
2. with a ready pre-warmed process (no interpreter start, no imports);
3. whose weight cache holds the model (no disk read), then one that has its
   files at all (no fork from a peer: NodeReport.serves);
4. with the most free devices (None counts as many), then the most memory;
5. the first by name (deterministic).

A placement in flight counts against its node until the node's report says
it took the ScaleOut (NodeReport.scale_outs): a report sent before the order
arrived does not free the devices the order takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepserve.messages.scaling import NodeReport


@dataclass
class _Node:
    report: NodeReport
    seen_at: float
    acked: int = 0  # ScaleOut TEs this run of the node says it took
    lost: bool = False
    pending: list[str] = field(default_factory=list)  # models placed here, not yet taken


class HostBook:
    """timeout_s: a node silent this long is lost; local: the CM's own node's
    address (never lost: the CM is its child, and a stalled supervisor there
    restarts its own TEs)."""

    def __init__(self, timeout_s: float, local: str = ""):
        self.timeout_s, self.local = timeout_s, local
        self._nodes: dict[str, _Node] = {}
        self._te_node: dict[str, str] = {}  # TE id -> node (last known, lost nodes too)

    # -- inputs ------------------------------------------------------------------
    def on_report(self, report: NodeReport, now: float) -> bool:
        """True: a node not known until now (new, restarted, or back after it was lost)."""
        node = self._nodes.get(report.node)
        joined = node is None or node.lost or node.report.run_id != report.run_id
        if node is None or node.report.run_id != report.run_id:
            node = self._nodes[report.node] = _Node(report, now)
        node.report, node.seen_at, node.lost = report, now, False
        if report.scale_outs > node.acked:  # orders are taken in the order sent
            del node.pending[:report.scale_outs - node.acked]
            node.acked = report.scale_outs
        for te_id in report.tes:
            self._te_node[te_id] = report.node
        return joined

    def expire(self, now: float) -> list[str]:
        """Nodes whose reports stopped since the last call (each named once)."""
        lost = []
        for name, node in self._nodes.items():
            if not node.lost and now - node.seen_at > self.timeout_s \
                    and node.report.address != self.local:
                node.lost = True
                lost.append(name)
        return lost

    # -- questions ---------------------------------------------------------------
    def is_lost(self, name: str) -> bool:
        node = self._nodes.get(name)
        return node is not None and node.lost

    def node_of(self, te_id: str) -> str | None:
        return self._te_node.get(te_id)

    def tes_of(self, name: str) -> list[str]:
        """The scaled TEs `name` last reported."""
        node = self._nodes.get(name)
        return sorted(node.report.tes) if node is not None else []

    def static_of(self, name: str) -> list:
        """The [[te]] TEs `name` last reported (NodeReport.static)."""
        node = self._nodes.get(name)
        return list(node.report.static) if node is not None else []

    def address(self, name: str) -> str | None:
        node = self._nodes.get(name)
        return None if node is None or node.lost else node.report.address

    def alive(self) -> list[str]:
        return sorted(n for n, node in self._nodes.items() if not node.lost)

    def choose(self, model: str, path: str, devices: int = 1, size: int = 0) -> str | None:
        """The node to start a TE of `model` (weights at `path`, `size` bytes,
        `devices` devices) on; None when no live node has the room."""
        best, best_key = None, None
        for name in sorted(self._nodes):  # '>' below: ties go to the first name
            node = self._nodes[name]
            r, in_flight = node.report, len(node.pending)
            free = math.inf if r.free_devices is None else r.free_devices - in_flight * devices
            if node.lost or free < devices or r.available_bytes < size:
                continue
            replicas = sum(1 for m in r.tes.values() if m == model) + node.pending.count(model)
            key = (-replicas, r.ready_pods > in_flight, path in r.cached, path in r.serves,
                   free, r.available_bytes)
            if best_key is None or key > best_key:
                best, best_key = name, key
        return best

    def sources(self, path: str, exclude: str | None = None) -> list[str]:
        """Weight servers of live nodes (but `exclude`) holding model `path`'s
        files, those with it in memory (the weight cache) first."""
        holders = [n for n in self._nodes.values() if not n.lost and n.report.weights
                   and path in n.report.serves and n.report.node != exclude]
        holders.sort(key=lambda n: (path not in n.report.cached, n.report.node))
        return [n.report.weights for n in holders]

    def holds(self, name: str, path: str) -> bool:
        """Node `name` has model `path`'s files (it needs no fork)."""
        node = self._nodes.get(name)
        return node is not None and path in node.report.serves

    def weights_of(self, name: str) -> str:
        node = self._nodes.get(name)
        return node.report.weights if node is not None else ""

    def placed(self, name: str, model: str) -> None:
        """A ScaleOut for one TE of `model` was sent to `name`."""
        self._nodes[name].pending.append(model)

    def withdraw(self, name: str, model: str, count: int) -> None:
        """The last `count` placements of `model` on `name` were never delivered."""
        pending = self._nodes[name].pending
        for _ in range(count):
            if model in pending:
                del pending[len(pending) - 1 - pending[::-1].index(model)]

    def summary(self) -> dict:
        """name -> what placement last knew of it (for a decision's log)."""
        return {n: {"free_devices": node.report.free_devices, "ready_pods": node.report.ready_pods,
                    "tes": len(node.report.tes), "lost": node.lost,
                    "in_flight": len(node.pending)}
                for n, node in sorted(self._nodes.items())}
