"""Scaling channels of a node (DeepServe §6, "Fast scaling").

    gateway ──RequestLatencies (PUSH, at most every second)──> JE    TTFT / TPOT per model
    JE ──ModelDemand (PUSH, when it changes)──> CM        arrivals, requests held with no TE,
                                                          the gateway's latencies (SLO)
    CM (autoscaler) ──ScaleOut / ScaleIn (PUSH)──> the chosen node's supervisor (the head's:
                                                   its heartbeat inbox; a joined node's:
                                                   its node inbox, tcp [cluster] port+4)
    every node's supervisor ──NodeReport (PUSH, every NODE_REPORT_S)──> CM   (placement)
    supervisor ──Assign (PUSH)──> a pre-warmed TE process: become TE te_id of model
    supervisor ──ScaleEvent (PUSH)──> CM ──(PUB)──> gateways (/metrics), JEs

A ScaleEvent is sent once the new TE is listed (scale-out, with the time of
every stage) or gone (scale-in). Stages, in seconds (DeepServe's five):
scaler_pre (decision -> a process is given the TE: a pre-warmed one, or a
cold start), te_pre_load (process -> its tokenizer, master and workers
started), te_load (weights in the workers' memory), te_post_load (KV pool
and warm-up), scaler_post (TE announced -> in the TE list the CM pushes).
"""

from __future__ import annotations

import msgspec

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)
STAGES = ("scaler_pre", "te_pre_load", "te_load", "te_post_load", "scaler_post")
SOURCES = ("cold", "prewarmed", "prewarmed_cache")
"""How a TE came up: a new process loading from disk; a pre-warmed process
loading from disk; a pre-warmed process loading from the node's weight cache."""


class ModelDemand(msgspec.Struct, tag="model_demand", **_STRUCT):
    """model -> requests that arrived since the last ModelDemand; model ->
    requests held now because no TE of the model can take them."""

    arrivals: dict[str, int] = {}
    parked: dict[str, int] = {}
    latencies: dict[str, list[tuple[float | None, float | None]]] = {}
    """model -> (TTFT ms, TPOT ms) of requests that finished (the SLO's samples)."""


class RequestLatencies(msgspec.Struct, tag="latencies", **_STRUCT):
    """model -> (TTFT ms, TPOT ms or None) of requests that completed at a gateway."""

    samples: dict[str, list[tuple[float | None, float | None]]] = {}


class ScaleOut(msgspec.Struct, tag="scale_out", **_STRUCT):
    model: str
    count: int = 1
    reason: str = ""
    inputs: dict = {}
    decided_at: float = 0.0
    """time.monotonic() of the decision (the CM's clock); 0: when received."""
    path: str = ""
    """The model's directory ([[model]] path, as on the head): a joined node that
    does not declare the model serves it from this path ("": its own spec)."""
    options: dict = {}
    """The model's EngineConfig options (with path: the whole spec, as declared)."""
    sources: list[str] = []
    """Weight servers of nodes that hold the model's files: a node without its
    directory forks them from the first that answers (cache/weight_fork.py)."""
    term: int = 0
    """The ordering head's term (head_terms.py): a node that heard a higher one
    drops the order (a deposed head's, sent before it stepped down)."""


NODE_REPORT_S = 1.0
"""How often every node's supervisor sends its NodeReport."""


class StaticTE(msgspec.Struct, array_like=True, frozen=True):
    """A node's [[te]] TE, as the CM needs it to replace it elsewhere if the node is lost."""

    te_id: str
    model: str  # the name clients use ([node] served_model)
    path: str  # its model directory ([node] model)
    te_type: str = "colocated"


class NodeReport(msgspec.Struct, tag="node_report", **_STRUCT):
    """One node's capacity for scaled TEs, as the CM's placement needs it
    (control/cm/hosts.py); the CM counts a node lost once its reports stop."""

    node: str
    """The node's [cluster] name ("" on a single host)."""
    run_id: str
    """The node's run: a node restarted under the same name is a new one."""
    address: str
    """Where ScaleOut / ScaleIn reach its supervisor."""
    free_devices: int | None = None
    """Devices no TE holds ([node] num_devices minus every TE's tp); None: no limit."""
    available_bytes: int = 0
    """Host memory available (psutil)."""
    ready_pods: int = 0
    """Pre-warmed processes ready to be assigned."""
    cached: list[str] = []
    """Model directories whose weights its weight cache holds."""
    weights: str = ""
    """Its weight server ("": none): where peers fork the models in `serves` from."""
    serves: list[str] = []
    """Model directories (the head's names) whose files it holds: on disk, cached or forked."""
    tes: dict[str, str] = {}
    """Its scaled TEs (starting or up): TE id -> model."""
    static: list[StaticTE] = []
    """Its [[te]] TEs: if the node is lost, the CM starts the colocated ones elsewhere."""
    scale_outs: int = 0
    """ScaleOut TEs this run has taken: the CM's placements still in flight are
    those it sent beyond this count."""
    term: int = 0
    """The highest head term the node has heard (TEList.term): a head whose own
    is lower was deposed and steps down (control/cm/cluster_manager.py)."""


class ScaleIn(msgspec.Struct, tag="scale_in", **_STRUCT):
    """Stop te_id (drained: the CM has routed nothing to it since it chose it)."""

    te_id: str
    model: str
    reason: str = ""
    inputs: dict = {}
    term: int = 0
    """The ordering head's term (ScaleOut.term)."""


class ScaleEvent(msgspec.Struct, tag="scale_event", **_STRUCT):
    """direction: "out" (listed), "in" (gone) or "failed" (a start that did not come up)."""

    model: str
    te_id: str
    direction: str
    source: str = ""
    reason: str = ""
    stages: dict[str, float] = {}
    total_s: float = 0.0


class Assign(msgspec.Struct, tag="assign", **_STRUCT):
    """To a pre-warmed process: serve as TE te_id of model, naming shared memory by run_id."""

    te_id: str
    model: str
    run_id: str
    sent_at: float = 0.0
    """time.monotonic() of the sender (same node): the process times its own wait from it."""
