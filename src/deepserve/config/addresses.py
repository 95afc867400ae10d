"""The sockets of one run of a node: where its processes bind and connect.

    one host         every socket ipc:// in the run directory (RunAddresses.in_dir)
    many hosts       what other hosts reach binds tcp://[cluster] host:port+k
                     (config/cluster.py: the head's cluster manager, PUB and
                     job executor, gateway replies, TE inboxes, a joined node's
                     supervisor inbox, every node's weight server); same-host
                     sockets stay ipc://
    standby heads    the head's sockets are lists ("tcp://S:p,tcp://H:p"):
                     processes bind the first (their host's) and connect to all
                     (ipc/sockets.py), so they reach whichever head is alive

The node derives them (RunAddresses.for_node) and writes them into the run's
resolved config; its children read them from there (config/loading.py).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from deepserve.config.cluster import (GATEWAY_PORT_OFFSET, HEAD_WEIGHTS_PORT_OFFSET,
                                      JE_PORT_OFFSET, KV_PEER_PORT_OFFSET, NODE_PORT_OFFSET,
                                      WEIGHTS_PORT_OFFSET, ClusterSection)


class RunAddresses(msgspec.Struct, frozen=True, kw_only=True):
    """The sockets of one run (all ipc:// in the run directory); the node
    derives them, children read them from the resolved config file."""

    run_id: str
    cm: str
    """The cluster manager's inbox (TEUp / TEDown / TEReport)."""
    cm_pub: str
    """The cluster manager's PUB (TEList, TEReport) for JEs, gateways, the supervisor."""
    je: str
    """The job executor's inbox (SubmitRequest / AbortRequest from gateways)."""
    gw_reply: str
    """The gateway's reply inbox (RequestDelta / RequestFailed)."""
    hb: str
    """The supervisor's heartbeat inbox (also in $DEEPSERVE_HEARTBEAT, which ActorLife reads)."""
    tes: dict[str, str] = {}
    """TE id -> the inbox its tokenizer binds (the [[te]] TEs)."""
    kv_cache: str = ""
    """The KV tier service's inbox ("" when [node] host_cache_bytes is 0)."""
    run_dir: str = ""
    """Where TEs started later (scaling) and pre-warmed processes bind theirs."""
    node_inbox: str = ""
    """A joined node's supervisor's tcp inbox ([cluster] port+4): the head's CM sends
    it ScaleOut / ScaleIn; "": the heartbeat inbox (the CM is on this host)."""
    kv_peer: str = ""
    """The KV tier service's tcp socket for other hosts' ([cluster] port+7; the
    remote tier, tiers/remote_tier.py); "": one host, or no KV tier."""
    weights: str = ""
    """The node's weight server ([cluster] port+5, the head's port+6;
    cache/weight_fork.py): peers fork model files from it; "": one host, none."""

    @classmethod
    def for_node(cls, run_dir: str | Path, run_id: str, te_ids, kv_cache: bool,
                 cluster: ClusterSection) -> "RunAddresses":
        """One host: `in_dir`. Many ([cluster] host set): what other hosts reach
        binds tcp://host:port+k (the head's cluster manager, its PUB, the gateway's
        replies; every TE's inbox), or, on a joining node, points at the head's;
        same-host sockets (heartbeats, the KV tier, the JE's inbox) stay ipc://."""
        local = cls.in_dir(run_dir, run_id, te_ids, kv_cache)
        if not cluster.is_cluster:
            return local
        head = cluster.head_address
        own = lambda offset: f"tcp://{cluster.host}:{cluster.port + offset}"  # noqa: E731
        tes = {t: f"tcp://{cluster.host}:{cluster.te_port(i)}" for i, t in enumerate(te_ids)}
        heads = not cluster.joins or cluster.standby  # runs a gateway, may run CM and JE
        je = head(JE_PORT_OFFSET) if heads else ""  # gateways on other head hosts reach it
        node_inbox = own(NODE_PORT_OFFSET) if cluster.joins else ""
        weights = own(WEIGHTS_PORT_OFFSET if cluster.joins else HEAD_WEIGHTS_PORT_OFFSET)
        gw_reply = own(GATEWAY_PORT_OFFSET) if heads else head(GATEWAY_PORT_OFFSET)
        kv_peer = own(KV_PEER_PORT_OFFSET) if kv_cache else ""
        return msgspec.structs.replace(local, cm=head(0), cm_pub=head(1), je=je,
                                       gw_reply=gw_reply, tes=tes, node_inbox=node_inbox,
                                       weights=weights, kv_peer=kv_peer)

    @classmethod
    def in_dir(cls, run_dir: str | Path, run_id: str, te_ids,
               kv_cache: bool = False) -> "RunAddresses":
        at = lambda name: f"ipc://{run_dir}/{name}.sock"  # noqa: E731
        return cls(run_id=run_id, cm=at("cm"), cm_pub=at("cm-pub"), je=at("je"),
                   gw_reply=at("gw-reply"), hb=at("hb"), tes={t: at(t) for t in te_ids},
                   kv_cache=at("kv-cache") if kv_cache else "", run_dir=str(run_dir))

    def te_address(self, te_id: str) -> str:
        """The inbox of any TE (or pre-warmed process) of the run."""
        return self.tes.get(te_id) or f"ipc://{self.run_dir}/{te_id}.sock"
