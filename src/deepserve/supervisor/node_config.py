"""NodeConfig: one node of the platform, read from a TOML file in conf/.

    [node]      host, port, model, served_model, startup_timeout_s
    [gateway]   api_keys, max_open_requests, request_timeout_s
    [router]    policy, balance_threshold, pd_policy, pd_heatmap, pd_predictor, pd_options
    [supervisor] heartbeat_deadline_s, progress_deadline_s, startup_grace_s,
                memory_limit_mb, restart_base_delay_s, restart_max_delay_s,
                max_restarts, restart_window_s, log_dir, drill
    [[te]]      count, type, priority, and any EngineConfig option (processes is implied)
    [node]      ... num_devices: devices the node can give TEs (gang scheduling)

Unknown sections or keys are errors naming them. Relative paths are relative
to the repository root (the folder above conf/).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from deepserve.config import EngineConfig


@dataclass(frozen=True)
class TESpec:
    te_id: str
    te_type: str
    options: dict
    """EngineConfig options for this TE (model is the node's)."""
    priority: int = 0
    """Gang scheduling: a TE may evict TEs of lower priority to get its devices."""

    @property
    def num_devices(self) -> int:
        return int(self.options.get("tp", 1))


@dataclass(frozen=True)
class SupervisorConfig:
    heartbeat_deadline_s: float = 3.0
    """A watched process silent this long (after startup) is reported and replaced."""
    progress_deadline_s: float = 5.0
    """A process holding work whose progress counters stand still this long is hung."""
    startup_grace_s: float = 120.0
    """Seconds a process may take to send its first heartbeat."""
    memory_limit_mb: float | None = None
    """Resident memory per watched process past which it is a fault (oom)."""
    restart_base_delay_s: float = 0.5
    restart_max_delay_s: float = 30.0
    max_restarts: int = 5
    """Restarts allowed within restart_window_s; one more failure marks the component failed."""
    restart_window_s: float = 60.0
    kill_grace_s: float = 1.0
    """SIGTERM, then SIGKILL after this long (a faulty TE's state is soft: its
    shared memory is swept and its requests resume elsewhere, so no long wait)."""
    log_dir: str | None = None
    """Where health.jsonl goes; default: the node's run directory."""
    drill: bool = False
    """Enable fault hooks (drill/hooks.py) in every process; never in production."""


@dataclass(frozen=True)
class NodeConfig:
    model: str
    """Model directory every TE serves (and the JE tokenizes with)."""
    host: str = "127.0.0.1"
    port: int = 8000
    served_model: str = ""
    """Name clients put in `model`; default: the model directory's name."""
    startup_timeout_s: float = 180.0
    """Seconds for every process to come up and the gateway to report healthy."""
    api_keys: dict = field(default_factory=dict)
    """API key -> tenant; empty: no authentication, one tenant."""
    max_open_requests: int = 256
    """Open requests at the gateway past which it answers 429."""
    request_timeout_s: float = 600.0
    """Deadline of one request, end to end."""
    policy: str = "combined"
    """Routing: combined, locality, load or round_robin."""
    balance_threshold: float | None = None
    """Load difference under which locality decides (router default if None)."""
    pd_policy: str | None = None
    """Colocated or disaggregated per request (control/pd_policy.py): heatmap,
    threshold, colocated, disaggregated; None: colocated while a colocated TE exists."""
    pd_heatmap: str | None = None
    """JSON heatmap written by tools/profile_pd.py."""
    pd_predictor: str | None = None
    """JSON decode-length predictor written by tools/train_predictor.py."""
    pd_options: dict = field(default_factory=dict)
    """PDPolicy thresholds: margin, min_prompt_len, max_decode_len."""
    te_timeout_s: float = 10.0
    """A TE with no report for this long leaves the TE list."""
    num_devices: int | None = None
    """Devices this node can give TEs (a TE takes tp of them); None: no limit."""
    max_attempts: int = 3
    """TEs one request may run on: it resumes elsewhere when its TE is lost."""
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    tes: tuple[TESpec, ...] = ()

    def __post_init__(self):
        if not self.tes:
            raise ValueError("a node needs at least one [[te]]")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for te in self.tes:  # fail now, not in a child process
            EngineConfig.from_options(self.model, **{**te.options, "processes": True})


_SECTIONS = {"node": {"host", "port", "model", "served_model", "startup_timeout_s", "te_timeout_s",
                      "num_devices", "max_attempts"},
             "gateway": {"api_keys", "max_open_requests", "request_timeout_s"},
             "router": {"policy", "balance_threshold", "pd_policy", "pd_heatmap", "pd_predictor",
                        "pd_options"}}


def load_node_config(path: str | Path, overrides: dict | None = None) -> NodeConfig:
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    unknown = sorted(set(raw) - set(_SECTIONS) - {"te", "supervisor"})
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {unknown}")
    flat: dict = {}
    for section, keys in _SECTIONS.items():
        bad = sorted(set(raw.get(section, {})) - keys)
        if bad:
            raise ValueError(f"{path}: unknown key(s) {bad} in [{section}]")
        flat.update(raw.get(section, {}))
    flat.update(overrides or {})
    root = Path(path).resolve().parent.parent
    model = Path(flat.pop("model"))
    flat["model"] = str(model if model.is_absolute() else root / model)
    flat.setdefault("served_model", Path(flat["model"]).name)
    for key in ("pd_heatmap", "pd_predictor"):
        if flat.get(key) is not None and not Path(flat[key]).is_absolute():
            flat[key] = str(root / flat[key])
    sup = dict(raw.get("supervisor", {}))
    known = set(SupervisorConfig.__dataclass_fields__)
    if set(sup) - known:
        raise ValueError(f"{path}: unknown key(s) {sorted(set(sup) - known)} in [supervisor]")
    if sup.get("log_dir") is not None and not Path(sup["log_dir"]).is_absolute():
        sup["log_dir"] = str(root / sup["log_dir"])
    return NodeConfig(tes=tuple(_te_specs(raw.get("te", []))), supervisor=SupervisorConfig(**sup),
                      **flat)


def _te_specs(tables: list[dict]) -> list[TESpec]:
    specs: list[TESpec] = []
    for table in tables:
        options = dict(table)
        count, te_type = int(options.pop("count", 1)), options.pop("type", "colocated")
        priority = int(options.pop("priority", 0))
        options.pop("processes", None)
        for _ in range(count):
            specs.append(TESpec(f"te{len(specs)}", te_type, options, priority))
    return specs


def with_port(config: NodeConfig, host: str | None, port: int | None) -> NodeConfig:
    return replace(config, host=host or config.host, port=port or config.port)

