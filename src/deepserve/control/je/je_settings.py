"""What the job executor takes from the node's resolved config (load_settings)."""

from __future__ import annotations

import msgspec

from deepserve.config.child import ChildArgs
from deepserve.config.loading import read_run_config
from deepserve.config.node import RouterSection
from deepserve.config.tenants import TenantsSection

PARK_S = 10.0
"""Seconds a request that no TE can take waits for one (job_executor.py)."""

__all__ = ["PARK_S", "JESettings", "load_settings"]


class JESettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the job executor takes from the node's resolved config."""

    inbox: str
    cm_pub: str
    models: dict[str, str]
    """Served model name -> directory (its tokenizer); the first is the default."""
    scalable: tuple[str, ...] = ()
    """Models the autoscaler starts on demand."""
    cm: str = ""
    """The cluster manager's inbox (ModelDemand)."""
    queue_timeout_s: float = PARK_S
    """[scaling] queue_timeout_s: how long a request for a model with no TE waits."""
    max_attempts: int
    """[node] max_attempts."""
    router: RouterSection
    """[router]: routing policy, PD policy and its files and thresholds."""
    kv_cache: str = ""
    """The KV tier service's inbox (ContextUnpin); "": none."""
    contexts_path: str = ""
    """Where the context registry is kept: contexts.json in [cluster] state_dir
    (shared with standby heads), else in the run directory."""
    continuity: bool = True
    """[router] token_continuity."""
    turn_pin_s: float = 0.0
    """[node] tool_call_pin_s where the node has a host tier, else 0 (turn_pins.py)."""
    tenants: TenantsSection = TenantsSection()
    """[tenants]: weights and limits per tenant (control/je/fair_share.py)."""


def load_settings(args: ChildArgs) -> JESettings:
    config, run = read_run_config(args.conf)
    return JESettings(inbox=run.je, cm_pub=run.cm_pub, models=config.served_models,
                      scalable=tuple(m.name for m in config.all_models if m.scalable),
                      cm=run.cm, queue_timeout_s=config.scaling.queue_timeout_s,
                      max_attempts=config.node.max_attempts, router=config.router,
                      kv_cache=run.kv_cache,
                      contexts_path=f"{config.cluster.state_dir or run.run_dir}/contexts.json",
                      continuity=config.router.token_continuity, tenants=config.tenants,
                      turn_pin_s=config.node.tool_call_pin_s if config.node.host_cache_bytes
                      else 0.0)
