"""[cluster]: one node of many hosts (a head, or a node that joins one).

    head   [cluster] host = H            cluster manager tcp://H:port, its PUB :port+1,
                                         gateway replies :port+3; TEs :port+8, 4 ports each
    node   [cluster] host = N, head = H:P  its supervisor's inbox tcp://N:port+4 (the CM's
                                         ScaleOut / ScaleIn), weight server :port+5 (fork;
                                         the head's: port+6); its TEs tcp://N:port+8...
                                         (scaled ones after its [[te]] ones); the head's sockets
                                         for the cluster manager, its PUB and replies

RunAddresses.for_node (config/node.py) turns this into a run's addresses;
sockets that stay on one host (heartbeats, the KV tier, the job executor's
inbox, a TE's own processes) remain ipc:// and shared memory.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*", "[::]")
TE_PORT_OFFSET = 8
"""[cluster] ports: the head's control sockets take port .. port+3, its TEs (and
a joining node's from `port` on) take TE_PORTS_EACH each after this offset."""
NODE_PORT_OFFSET = 4
"""A joined node's supervisor inbox (ScaleOut / ScaleIn from the head's CM): port+4."""
WEIGHTS_PORT_OFFSET = 5
"""A joined node's weight server (fork: peers pull model files from it): port+5;
the head's is port+6 (HEAD_WEIGHTS_PORT_OFFSET), so that a joined node on the
head's host with the same port (as Ray's fabric starts one) takes none of the head's."""
HEAD_WEIGHTS_PORT_OFFSET = 6
TE_PORTS_EACH = 4
"""A TE's inbox P, its master's PD inbox P+1 (messages/pd.py), its tier replies P+2."""


class ClusterSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Many hosts: a head node (cluster manager, job executor, gateway, and any
    TEs) and joining nodes (their TEs only), over ZeroMQ tcp between hosts;
    processes of one host still use ipc:// and shared memory."""

    host: str = ""
    """This host's address, which every cross-host socket binds (never a wildcard:
    peers are told the bound address); "": one host, everything over ipc://."""
    port: Annotated[int, Meta(ge=1024, le=60000)] = 7400
    """First TCP port of this node: the head's cluster manager inbox (port), its PUB
    (port+1), the gateway's reply inbox (port+3); TEs from port+8, 4 ports each."""
    head: str = ""
    """HOST:PORT of the head's [cluster] host and port: this node joins that
    cluster and runs only its TEs (and its KV tier); "": this node is the head."""
    name: str = ""
    """This node's name, the prefix of its TE ids (h1-te0, ...) so they are unique
    in the cluster; "" (resolved on load): derived from host."""
    secure: bool = False
    """CURVE on every tcp:// ZeroMQ socket (control, KV tier, DistFlow) with the
    cluster key in `keys`: a host without it cannot join, list, inject or pull
    KV (refused, logged as peer_refused). Every node of a cluster sets the same."""
    keys: str = "var/keys"
    """Directory of the cluster key pair (bin/deepserve-keys DIR); relative to
    the repository root. Read only with secure = true."""

    def __post_init__(self):
        if self.host in WILDCARD_HOSTS[1:]:
            raise ValueError(f"host: {self.host!r} is a wildcard; name this host's address")
        if self.head:
            head_host, colon, head_port = self.head.rpartition(":")
            if not colon or not head_port.isdigit() or not head_host:
                raise ValueError(f"head: want HOST:PORT, got {self.head!r}")
            if not self.host:
                raise ValueError("head: a joining node needs host (its own address)")
        if not self.name and self.host:
            name = "".join(c if c.isalnum() else "-" for c in self.host).strip("-")
            msgspec.structs.force_setattr(self, "name", f"n{name}")
        if self.name and not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"name: letters, digits, - and _ only, got {self.name!r}")
        if self.secure and not self.host:
            raise ValueError("secure: needs host (one host uses ipc://, nothing to secure)")

    @property
    def is_cluster(self) -> bool:
        return bool(self.host)

    @property
    def joins(self) -> bool:
        """This node joins a head (runs TEs only)."""
        return bool(self.head)

    def head_address(self, offset: int) -> str:
        """tcp:// address of the head's socket at port + offset."""
        host, port = (self.head.rpartition(":")[::2] if self.head
                      else (self.host, str(self.port)))
        return f"tcp://{host}:{int(port) + offset}"

    def te_port(self, index: int) -> int:
        port = self.port + TE_PORT_OFFSET + TE_PORTS_EACH * index
        if port + TE_PORTS_EACH - 1 > 65535:
            raise ValueError(f"cluster: port {self.port}: TE #{index} would need port {port}")
        return port


def named_for_cluster(tes, cluster: ClusterSection) -> tuple:
    """A joining node's TEs are named after it (h1-te0, ...): TE ids are
    cluster-wide (the cluster manager's list, the job executor's routes).
    Renaming again (another name from the command line) replaces the prefix."""
    if not cluster.joins:
        return tuple(tes)
    return tuple(msgspec.structs.replace(te, te_id=f"{cluster.name}-{te.te_id.rsplit('-', 1)[-1]}")
                 for te in tes)
