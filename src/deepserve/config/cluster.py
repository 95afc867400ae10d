"""[cluster]: one node of many hosts (a head, or a node that joins one).

    head   [cluster] host = H            cluster manager tcp://H:port, its PUB :port+1,
                                         job executor :port+2, gateway replies :port+3;
                                         TEs :port+8, 4 ports each
    node   [cluster] host = N, head = H:P  its supervisor's inbox tcp://N:port+4 (the CM's
                                         ScaleOut / ScaleIn), weight server :port+5 (fork;
                                         the head's: port+6), KV tier for other hosts
                                         :port+7 (remote tier); its TEs tcp://N:port+8...
                                         (scaled ones after its [[te]] ones); the head's sockets
                                         for the cluster manager, its PUB and replies

standby  [cluster] host = S, head = H:P, standby = true: a joined node with
         a gateway (replies tcp://S:port+3) that binds the head's sockets on S
         (port .. port+2) when the head is silent for failover_s; nodes then join
         with head = "H:P,S:P" and talk to whichever head binds them.

RunAddresses.for_node (config/addresses.py) turns this into a run's addresses;
sockets that stay on one host (heartbeats, the KV tier, the job executor's
inbox, a TE's own processes) remain ipc:// and shared memory.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

import msgspec
from msgspec import Meta


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*", "[::]")
TE_PORT_OFFSET = 8
"""[cluster] ports: the head's control sockets take port .. port+3, its TEs (and
a joining node's from `port` on) take TE_PORTS_EACH each after this offset."""
JE_PORT_OFFSET = 2
"""The head's job executor inbox (gateways on every head host submit there): port+2."""
GATEWAY_PORT_OFFSET = 3
"""A head's (or standby head's) gateway reply inbox: port+3."""
NODE_PORT_OFFSET = 4
"""A joined node's supervisor inbox (ScaleOut / ScaleIn from the head's CM): port+4."""
WEIGHTS_PORT_OFFSET = 5
"""A joined node's weight server (fork: peers pull model files from it): port+5;
the head's is port+6 (HEAD_WEIGHTS_PORT_OFFSET), so that a joined node on the
head's host with the same port (as Ray's fabric starts one) takes none of the head's."""
HEAD_WEIGHTS_PORT_OFFSET = 6
KV_PEER_PORT_OFFSET = 7
"""Every node's KV tier service for other hosts' (the remote tier): port+7."""
TE_PORTS_EACH = 4
"""A TE's inbox P, its master's PD inbox P+1 (messages/pd.py), its tier replies P+2."""


def is_loopback(host: str) -> bool:
    """Only this host reaches `host` (127.0.0.0/8, ::1, localhost); a name or
    any other address may be reached from others."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    cluster and runs only its TEs (and its KV tier); "": this node is the head.
    Several, comma-separated ("H0:P,H1:P"): the head and its standby heads, in
    the order they take over; the node talks to whichever is alive."""
    standby: bool = False
    """A joining node that is a standby head: it runs a gateway of its own, and
    takes over the cluster manager and the job executor (started here, bound
    to this host's port .. port+3) once the head has been silent for failover_s.
    Other nodes list it in their `head` after the head. It declares the head's
    [[model]] tables too (its gateway serves them; its CM scales them once it
    took over) but starts none of their TEs itself."""
    state_dir: str = ""
    """A directory the head and its standby heads all reach (shared storage): the
    job executor keeps its context registry there (contexts.json), so a standby
    that takes over knows every context made before; "": the run directory (a
    standby knows none). Relative to the repository root."""
    failover_s: Annotated[float, Meta(ge=0.5, le=600)] = 4.0
    """A standby head takes over after the head's cluster manager has published
    nothing (it does every second) for this long: above the time the head's own
    supervisor takes to restart a crashed cluster manager (about 2 s)."""
    name: str = ""
    """This node's name, the prefix of its TE ids (h1-te0, ...) so they are unique
    in the cluster; "" (resolved on load): derived from host."""
    secure: bool = False
    """CURVE on every tcp:// ZeroMQ socket (control, KV tier, DistFlow) with the
    cluster key in `keys`: a host without it cannot join, list, inject or pull
    KV (refused, logged as peer_refused). Every node of a cluster sets the same."""
    keys: str = "var/keys"
    """Directory of the key files (bin/deepserve-keys DIR, then DIR --node NAME for
    this node's own pair, NAME its `name`); relative to the repository root. Read
    only with secure = true."""
    insecure: bool = False
    """Run with sockets that leave this host open to anyone who reaches them: a
    cluster host that is not loopback without secure, or a gateway bound beyond
    loopback without [gateway] api_keys. Without it such a node refuses to start;
    with it the node logs so at start and writes an `insecure` health event."""

    def __post_init__(self):
        if self.host in WILDCARD_HOSTS[1:]:
            raise ValueError(f"host: {self.host!r} is a wildcard; name this host's address")
        if self.head:
            heads = [h.strip() for h in self.head.split(",")]
            for head in heads:
                head_host, colon, head_port = head.rpartition(":")
                if not colon or not head_port.isdigit() or not head_host \
                        or not 1 <= int(head_port) <= 65535:
                    raise ValueError(f"head: want HOST:PORT[,HOST:PORT...], got {self.head!r}")
            if len(set(heads)) != len(heads):
                raise ValueError(f"head: a head named twice in {self.head!r}")
            if not self.host:
                raise ValueError("head: a joining node needs host (its own address)")
            if self.standby and f"{self.host}:{self.port}" in heads:
                raise ValueError(f"head: {self.host}:{self.port} is this node; a standby "
                                 "head lists the heads before it only")
        if self.standby and not self.head:
            raise ValueError("standby: a standby head joins the head it stands by for "
                             "(head = HOST:PORT)")
        if not self.name and self.host:
            name = "".join(c if c.isalnum() else "-" for c in self.host).strip("-")
            msgspec.structs.force_setattr(self, "name", f"n{name}")
        if self.name and not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"name: letters, digits, - and _ only, got {self.name!r}")
        if self.secure and not self.host:
            raise ValueError("secure: needs host (one host uses ipc://, nothing to secure)")
        if self.secure and self.insecure:
            raise ValueError("insecure: set with secure = true; choose one")

    @property
    def exposed(self) -> bool:
        """Its sockets leave this host with no key guarding them."""
        return self.is_cluster and not self.secure and not is_loopback(self.host)

    @property
    def is_cluster(self) -> bool:
        return bool(self.host)

    @property
    def joins(self) -> bool:
        """This node joins a head (runs TEs only)."""
        return bool(self.head)

    @property
    def heads(self) -> list[tuple[str, int]]:
        """(host, port) of every head this node may talk to, in the order they
        take over: a standby head itself first (its own sockets bind there)."""
        listed = [(h.rpartition(":")[0], int(h.rpartition(":")[2]))
                  for h in self.head.split(",") if h.strip()]
        own = [(self.host, self.port)] if self.standby or not self.head else []
        return own + listed

    def head_address(self, offset: int) -> str:
        """tcp:// address of the heads' socket at port + offset: several
        endpoints, comma-separated, with standby heads (ipc/sockets.py binds the
        first, which is this host's on a head, and connects to them all)."""
        return ",".join(f"tcp://{host}:{port + offset}" for host, port in self.heads)

    def te_port(self, index: int) -> int:
        port = self.port + TE_PORT_OFFSET + TE_PORTS_EACH * index
        if port + TE_PORTS_EACH - 1 > 65535:
            raise ValueError(f"cluster: port {self.port}: TE #{index} would need port {port}")
        return port


def open_sockets(cluster: ClusterSection, http_host: str, http_port: int,
                 api_keys: bool) -> list[str]:
    """What of a node leaves its host with nothing guarding it: its cluster
    sockets without CURVE, its gateway without API keys ([] if nothing)."""
    out = []
    if cluster.exposed:
        out.append(f"cluster sockets on {cluster.host} without CURVE")
    if not is_loopback(http_host) and not api_keys:
        out.append(f"gateway on {http_host}:{http_port} without api_keys")
    return out


def exposure_error(cluster: ClusterSection, http_host: str) -> str:
    """Why a node with open sockets (open_sockets) and no insecure is refused."""
    if cluster.exposed:
        return (f"cluster: host {cluster.host!r} is reached from other hosts and secure is "
                "off: anyone there could join, inject requests and read KV. Set secure = "
                "true with keys (bin/deepserve-keys), or insecure = true on a network you trust")
    return (f"node: host {http_host!r}: the gateway listens beyond this host with no "
            "[gateway] api_keys; set api_keys, or [cluster] insecure = true")


def named_for_cluster(tes, cluster: ClusterSection) -> tuple:
    """A joining node's TEs are named after it (h1-te0, ...): TE ids are
    cluster-wide (the cluster manager's list, the job executor's routes).
    Renaming again (another name from the command line) replaces the prefix."""
    if not cluster.joins:
        return tuple(tes)
    return tuple(msgspec.structs.replace(te, te_id=f"{cluster.name}-{te.te_id.rsplit('-', 1)[-1]}")
                 for te in tes)
