"""The node's schema: one msgspec Struct per TOML section of conf/node.toml.

    [node]        NodeSection        the model, the HTTP address, node-wide limits
    [gateway]     GatewaySection     auth, admission, request limits
    [router]      RouterSection      routing and PD policy (PDOptions: [router] pd_options)
    [supervisor]  SupervisorConfig   deadlines, restart budget, health log, drills
    [[te]]        TESection          type, count, priority + every EngineConfig option
    [[model]]     ModelSection       more models, scaled by the autoscaler (config/models.py)
    [scaling]     ScalingSection     pre-warmed pool, weight cache, autoscaler (config/models.py)
    [cluster]     ClusterSection     this host's address, the head a node joins (config/cluster.py)
    [tenants]     TenantsSection     tenants' weights and limits (config/tenants.py)
    (resolved)    RunAddresses       the run's sockets, written by the node, never in TOML

Decoding forbids unknown keys and checks ranges (Meta constraints); the
loader (config/loading.py) turns a failure into "FILE: [section] key: why".
NodeConfig is the resolved whole: paths absolute, [[te]] counts expanded
into TESpecs, and, once the node has made its run directory, `run`. The node
writes it to the run directory; every child reads it back and takes its part.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from deepserve.config.addresses import RunAddresses
from deepserve.config.cluster import (ClusterSection, exposure_error, named_for_cluster,
                                      open_sockets)
from deepserve.config.engine import EngineConfig
from deepserve.config.models import ModelSection, ModelSpec, ScalingSection, model_name
from deepserve.config.tenants import TenantsSection

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Count = Annotated[int, Meta(ge=1)]
TEType = Literal["colocated", "prefill", "decode"]
TE_TYPES = typing.get_args(TEType)


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A TOML section: immutable, unknown keys are errors."""


class NodeSection(Section):
    model: str = ""
    """Model directory (or .gguf file) the [[te]] TEs serve; "" with [[model]] tables only."""
    served_model: str = ""
    """Name clients put in `model`; "" (resolved on load): the model directory's name
    (a GGUF file's name without .gguf)."""
    host: str = "127.0.0.1"
    """Interface the gateway's HTTP server listens on."""
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    """TCP port of the gateway's HTTP server."""
    startup_timeout_s: Positive = 180.0
    """Seconds for every process to come up and the gateway to list every TE (node)."""
    te_timeout_s: Positive = 10.0
    """Seconds without a report after which the cluster manager drops a TE from the list."""
    num_devices: Annotated[int, Meta(ge=0)] | None = None
    """Devices this node can give TEs (a TE takes tp of them, gang scheduled); None: no
    limit; 0 (a head of many hosts only): no TE here, [[model]] TEs go to joined nodes."""
    max_attempts: Count = 3
    """TEs one request may run on (job executor): it resumes elsewhere when its TE is lost."""
    host_cache_bytes: Annotated[int, Meta(ge=0)] = 0
    """Bytes of node DRAM (shared memory) for the host KV tier, split evenly among the
    node's models and shared by each model's TEs; 0: no host tier (and no disk tier)."""
    disk_cache_dir: str = ""
    """Directory of the disk KV tier's block files (kept across node restarts); "": off."""
    disk_cache_bytes: Annotated[int, Meta(ge=0)] = 0
    """Bytes of block files the disk tier keeps (LRU), split evenly among the models."""
    disk_fsync: Literal["never", "always"] = "never"
    """fsync block files before they are renamed into place (tiers/block_file.py)."""
    disk_scrub_bytes_per_s: Annotated[int, Meta(ge=0)] = 4 << 20
    """Bytes of block files per second the tier service re-reads to find damaged ones
    before a TE does (tiers/disk_upkeep.py); 0: no scrub (a read still finds them)."""
    context_cache_bytes: Annotated[int, Meta(ge=0)] = 0
    """Bytes of KV blocks that contexts (POST /v1/contexts) may pin, split among the
    models; 0: half of the lowest tier (disk if on, else host)."""
    tool_call_pin_s: Annotated[float, Meta(ge=0, le=3600)] = 30.0
    """Seconds a chat turn whose reply ended in tool calls keeps its KV (prompt and
    reply) in the host tier, whatever else comes, for the turn that brings the tools'
    results (control/je/turn_pins.py); 0: not kept apart. Needs host_cache_bytes and
    [router] token_continuity (the turn's ids are the ones it keeps)."""
    cache_cost_model: bool = True
    """Fetch cached blocks from host / disk only when that beats recomputing them
    (measured bandwidths and prefill speed); false: fetch every hit."""
    gguf_cache_dir: str = "models/gguf"
    """Where the node imports the .gguf files its models name (Hugging Face directories
    keyed by each file's content, made once before any TE starts; relative: to the root)."""

    def __post_init__(self):
        if not self.served_model:  # derived before anyone reads it; frozen after
            msgspec.structs.force_setattr(self, "served_model", model_name(self.model))

    @property
    def has_disk_tier(self) -> bool:
        return bool(self.disk_cache_dir and self.disk_cache_bytes > 0)


def check_admin_keys(admin_keys, api_keys) -> None:
    """ValueError unless every admin key is one of api_keys (the gateway's config
    checks the same: gateway/config.py)."""
    for i, key in enumerate(admin_keys):
        if key not in api_keys:  # the position, not the key: it is a secret
            raise ValueError(f"admin_keys: entry {i + 1} is not a key of api_keys "
                             "(an admin key must also be an API key)")


class GatewaySection(Section):
    api_keys: dict[str, str] = {}
    """API key -> tenant (the tenant salts the prefix cache); empty: no auth, one tenant."""
    admin_keys: list[str] = []
    """API keys (each one of api_keys) that read every tenant's series on /metrics;
    any other key sees only its own tenant's."""
    max_open_requests: Count = 256
    """Sub-requests open at once at the gateway (n counts n); past it: 429."""
    request_timeout_s: Positive = 600.0
    """Seconds from admission to the last token; past it the request is aborted."""
    max_prompt_chars: Count = 1_000_000
    """Characters (or token ids) of prompt / messages at most; past it: 400."""
    default_max_tokens: Count | None = None
    """max_tokens of a request that gives none; unset: the model's max_new_tokens
    capped by the rest of the context, else all of the rest (as vLLM)."""
    max_body_bytes: Count = 8 * 1024 * 1024
    """Bytes of an HTTP request body at most; past it: 413, before the body is
    read or parsed and before authentication."""
    max_connections: Count = 1024
    """HTTP connections open at once at most; one past it is answered 503 (an
    OpenAI error body) and closed."""
    read_timeout_s: Positive = 15.0
    """Seconds a connection has to send a whole request (head and body) from
    when it opened or its previous response ended; past it: closed (half-open,
    slow-header and slow-body clients)."""
    write_timeout_s: Positive = 30.0
    """Seconds a client may leave response bytes unread; past it the connection
    is cut off and its sub-requests aborted."""
    max_queued_replies: Count = 1024
    """Replies (token deltas) one request may have waiting for its HTTP writer;
    past it the client is cut off as not reading and its sub-requests aborted."""

    def __post_init__(self):
        check_admin_keys(self.admin_keys, self.api_keys)


class PDOptions(Section):
    """Thresholds of the "threshold" PD policy (control/je/routing/pd_policy.py)."""

    margin: float = 1.0
    """Heatmap value (summed over the map's rates) a cell must exceed to go
    disaggregated; cells within noise stay colocated. A per-rate ratio moves by
    about 0.3 between runs on one machine; the shipped map sums 3 rates, so
    1.0 is about two standard deviations (2 x 0.3 x sqrt(3))."""
    min_prompt_len: Annotated[int, Meta(ge=0)] = 1024
    """Prompt tokens from which a request may go disaggregated."""
    max_decode_len: Annotated[int, Meta(ge=0)] = 128
    """Predicted output tokens up to which a long prompt goes disaggregated."""


class DualPathOptions(Section):
    """DualPath's scheduler (control/je/routing/dualpath.py), an inline table:
    { alpha_tokens = 8192, beta_tokens = 65536, z_factor = 1.05 }."""

    alpha_tokens: Annotated[int, Meta(ge=0)] = 8192
    """A storage read queue of at most this many tokens is short (a prefill TE's C2 class)."""
    beta_tokens: Count = 65536
    """A prefill TE with more unfinished tokens than this takes nothing new (C1)."""
    z_factor: Annotated[float, Meta(ge=1.0)] = 1.05
    """Decode TEs past z_factor x the group's mean tokens are the last choice."""
    read_paths: Literal["both", "prefill"] = "both"
    """"prefill": the prefill TE always reads its KV from storage itself (the
    baseline DualPath improves on: the decode TEs' storage bandwidth idles)."""


class RouterSection(Section):
    policy: Literal["combined", "locality", "load", "round_robin"] = "combined"
    """Which TE of a type serves a request (control/je/routing/router.py)."""
    balance_threshold: NonNegative | None = None
    """Load difference (tokens) under which cache locality decides; None: the router's default."""
    pd_policy: Literal["heatmap", "threshold", "colocated", "disaggregated"] | None = None
    """Colocated or disaggregated per request; None: colocated while a colocated TE exists."""
    pd_heatmap: str | None = None
    """JSON heatmap written by tools/profile_pd.py (pd_policy "heatmap")."""
    pd_predictor: str | None = None
    """JSON decode-length predictor written by tools/train_predictor.py."""
    pd_options: PDOptions = PDOptions()
    """Thresholds of the PD policy, an inline table: { margin = 0.0, min_prompt_len = 1024 }."""
    dualpath: DualPathOptions | None = None
    """Route disaggregated jobs with DualPath's two-level scheduler: a prefill TE by
    read queue and tokens, a decode TE by tokens and room, and per request the side
    with the shorter storage read queue reads its cached KV; unset: the router."""
    token_continuity: bool = True
    """Tokenize a chat turn that continues an earlier one (same tenant) as that
    turn's exact prompt + reply ids and the rest (control/je/turns.py), so its KV hits."""
    isolate_suspects: bool = False
    """Resume a request whose TE crashed only in isolation (control/je/suspects.py): never
    beside another suspect, only while another TE stays free of suspects, back on the TE
    it crashed once that is up. A request of death then restarts one TE (twice) and never
    the node, but every request of a crashed TE waits for its restart (seconds). False:
    resume at once on any TE (a second crash still quarantines the request)."""


class SupervisorConfig(Section):
    heartbeat_deadline_s: Positive = 3.0
    """Seconds a watched process may stay silent (after startup) before it is replaced."""
    progress_deadline_s: Positive = 5.0
    """Seconds a process holding work may show no progress before it counts as hung."""
    startup_grace_s: Positive = 120.0
    """Seconds a process may take to send its first heartbeat."""
    memory_limit_mb: Positive | None = None
    """Resident memory (MiB) per watched process past which it is a fault (oom); None: no limit."""
    restart_base_delay_s: NonNegative = 0.5
    """Seconds before the first restart; doubles per restart up to restart_max_delay_s."""
    restart_max_delay_s: NonNegative = 30.0
    """Longest wait (seconds) before a restart."""
    max_restarts: Annotated[int, Meta(ge=0)] = 5
    """Restarts allowed within restart_window_s; one more failure leaves the component down.
    The pre-warmed pool counts its pods' deaths the same way, as one component
    (supervisor/pool_backoff.py): one more gives the pool up and TEs start cold."""
    restart_window_s: Positive = 60.0
    """Seconds over which restarts are counted."""
    kill_grace_s: NonNegative = 1.0
    """Seconds between SIGTERM and SIGKILL when replacing a process (its state is soft)."""
    log_dir: str | None = None
    """Where health.jsonl goes; None: the node's run directory."""
    drill: bool = False
    """Enable fault hooks (faults.py) in every process; never in production."""


_ENGINE_HINTS = typing.get_type_hints(EngineConfig)
ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig) if f.name != "model")
"""The engine options a [[te]] table takes: EngineConfig's fields, not a copy."""

TESection = msgspec.defstruct(
    "TESection",
    [("type", TEType, "colocated"), ("count", Count, 1),
     ("priority", int, 0)]
    + [(f.name, _ENGINE_HINTS[f.name], f.default) for f in fields(EngineConfig)
       if f.name != "model" and f.default is not MISSING],
    bases=(Section,), module=__name__)
TESection.__doc__ = """One [[te]] table: `count` TEs (>= 1) of `type` (colocated, prefill or
decode) with gang-scheduling `priority` (a TE may evict lower ones), and any
EngineConfig option (documented there; `processes` is implied)."""


class TESpec(msgspec.Struct, frozen=True):
    """One TE of the node, after [[te]] counts are expanded (te0, te1, ...)."""

    te_id: str
    te_type: str
    options: dict = {}
    """EngineConfig options given for this TE (model is the node's)."""
    priority: int = 0
    """Gang scheduling: a TE may evict TEs of lower priority to get its devices."""

    @property
    def num_devices(self) -> int:
        return int(self.options.get("tp", 1))

    def engine_config(self, model: str) -> EngineConfig:
        return EngineConfig.from_options(model, **{**self.options, "processes": True})


FLAT_SECTIONS = ("node", "gateway", "router")
"""Sections whose keys NodeConfig also answers flat (config.port is config.node.port)."""


class NodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A node, resolved: one field per section, TEs expanded, paths absolute.
    Every process of the node reads this one object (from the run directory);
    none re-parses TOML or receives options as flags."""

    node: NodeSection
    gateway: GatewaySection = GatewaySection()
    router: RouterSection = RouterSection()
    supervisor: SupervisorConfig = SupervisorConfig()
    tes: tuple[TESpec, ...] = ()
    models: tuple[ModelSpec, ...] = ()
    """The [[model]] tables (and command-line models), scaled by the autoscaler."""
    scaling: ScalingSection = ScalingSection()
    cluster: ClusterSection = ClusterSection()
    tenants: TenantsSection = TenantsSection()
    run: RunAddresses | None = None
    """Set by the node once its run directory exists (None in what conf/ files give)."""
    term: int = 0
    """The head term this node's cluster manager serves (supervisor/head_terms.py):
    set by the node when it starts as the head or takes over; 0: not a head."""
    learned: tuple[ModelSpec, ...] = ()
    """Models the head's autoscaler placed on this joined node (a ScaleOut's path and
    options): set by the node at run time, never in conf/ files."""

    def __post_init__(self):
        if not self.tes and not self.models and not self.cluster.is_cluster:
            raise ValueError("te: a node needs at least one [[te]] or [[model]]")
        if self.cluster.joins and self.models and not self.cluster.standby:
            raise ValueError("model: a joining node runs [[te]] TEs only; [[model]] tables "
                             "(scaled TEs) live on the head (and its standby heads)")
        if self.cluster.is_cluster and not self.cluster.joins and not self.tes \
                and not self.models and not self.node.model:
            raise ValueError('node: model: required (model = "DIR")')
        if self.node.num_devices == 0 and (self.tes or not self.cluster.is_cluster
                                           or self.cluster.joins):
            raise ValueError("node: num_devices = 0 (no TE here) is for a head of many hosts "
                             "without [[te]] tables: its [[model]] TEs go to joined nodes")
        if self.tes and not self.node.model:
            raise ValueError('node: model: required with [[te]] tables (model = "DIR")')
        for te in self.tes:  # fail now, not in a child process
            if te.te_type not in TE_TYPES:
                raise ValueError(f"te: type must be one of {TE_TYPES}, got {te.te_type!r}")
            te.engine_config(self.node.model)
        names = [m.name for m in self.all_models]
        if len(set(names)) != len(names):
            raise ValueError(f"model: two models are named alike: {names}")
        for model in self.models:
            model.check()
        self.tenants.check_names(set(self.gateway.api_keys.values()))
        n = self.node
        if n.disk_cache_dir and n.disk_cache_bytes and not n.host_cache_bytes:
            raise ValueError("node: disk_cache_bytes: the disk tier is fed through the host "
                             "tier; set host_cache_bytes too")
        if not self.cluster.insecure and self.insecure_sockets:
            raise ValueError(exposure_error(self.cluster, self.node.host))

    @property
    def insecure_sockets(self) -> list[str]:
        """What leaves this host unguarded ([cluster] insecure; logged at start)."""
        return open_sockets(self.cluster, self.node.host, self.node.port,
                            bool(self.gateway.api_keys))

    @property
    def all_models(self) -> tuple[ModelSpec, ...]:
        """Every model the node serves: the [node] model of the [[te]] TEs (if
        any; not scalable) first, then the [[model]] ones."""
        static = ()
        if self.tes or (self.cluster.is_cluster and self.node.model):
            static = (ModelSpec(name=self.node.served_model, path=self.node.model,
                                min_tes=len(self.tes), max_tes=len(self.tes), scalable=False),)
        return static + self.models

    @property
    def served_models(self) -> dict[str, str]:
        """Model name (what clients put in `model`) -> its directory."""
        return {m.name: m.path for m in self.all_models}

    def initial_scaled_tes(self) -> dict[str, str]:
        """TE id -> model of the TEs the node starts for scalable models'
        min_tes (the CM expects them; later ones are numbered on)."""
        if self.node.num_devices == 0 or self.cluster.joins:  # the CM places them on
            return {}  # joined nodes / a standby head's [[model]] are the head's, till it dies
        return {m.te_id(i): m.name for m in self.models for i in range(m.min_tes)}

    def model_spec(self, name: str) -> ModelSpec:
        for spec in self.all_models + self.learned:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def __getattr__(self, name: str):
        """Flat reads of [node], [gateway] and [router] keys (their names are unique)."""
        if not name.startswith("_") and name not in self.__struct_fields__:
            for section in FLAT_SECTIONS:
                part = getattr(self, section)
                if name in part.__struct_fields__:
                    return getattr(part, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def build(cls, *, tes=(), supervisor: SupervisorConfig | None = None, models=(),
              scaling: ScalingSection | None = None, cluster: ClusterSection | None = None,
              **keys) -> "NodeConfig":
        """From flat keys (model=..., port=..., policy=...), each put in the
        section that has it, decoded with the same checks as a TOML file."""
        sections: dict[str, dict] = {name: {} for name in FLAT_SECTIONS}
        for key, value in keys.items():
            owner = [s for s in FLAT_SECTIONS if key in _SECTION_TYPES[s].__struct_fields__]
            if not owner:
                raise ValueError(f"unknown node config key {key!r}")
            sections[owner[0]][key] = value
        parts = {name: msgspec.convert(raw, _SECTION_TYPES[name]) for name, raw in sections.items()}
        cluster = cluster or ClusterSection()
        return cls(tes=named_for_cluster(tes, cluster), supervisor=supervisor or SupervisorConfig(),
                   models=tuple(models), scaling=scaling or ScalingSection(), cluster=cluster,
                   **parts)

    def with_run(self, run: RunAddresses) -> "NodeConfig":
        return msgspec.structs.replace(self, run=run)


_SECTION_TYPES = {"node": NodeSection, "gateway": GatewaySection, "router": RouterSection,
                  "supervisor": SupervisorConfig, "te": TESection, "model": ModelSection,
                  "scaling": ScalingSection, "cluster": ClusterSection,
                  "tenants": TenantsSection}
"""TOML section name -> its Struct (the loader's only list of sections)."""
