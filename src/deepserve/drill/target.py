"""What a drill aims at: the node's TEs and model, and the components its
fault goes to.

    aim(scenario, te, te_types, cluster)  -> (target, components)
        node-level process (kill-cm ...)   the process itself
        node kill (kill-node)              the node (n2) and its TEs
        head kill (kill-head)              the head itself
        scale-across                       "" until placed_target() after the
                                           first requests: the node the head's
                                           autoscaler placed the model's TE on
        otherwise                          te0 (or the scenario's TE type) and its part
"""

from __future__ import annotations

import json
import time
import urllib.request

from deepserve.drill.health_events import HealthEvents
from deepserve.drill.scenarios import Scenario, target_te, target_tes
from deepserve.supervisor.node import num_tes

POLL_S = 0.2


def aim(scenario: Scenario, te: str | None, te_types: dict[str, str],
        cluster=None) -> tuple[str, list[str]]:
    """(the target TE, node process or node; the components the fault goes to)."""
    if scenario.node_process:  # kill-cm / kill-je: the process is its own "TE"
        return scenario.part, [scenario.part]
    if scenario.kills_head:  # the head process (and every process under it)
        return scenario.part, [scenario.part]
    if scenario.kills_node:  # the node's TEs are the components
        if cluster is None:
            raise RuntimeError(f"{scenario.name}: runs on a cluster the drill starts (no --url)")
        node = te or scenario.part
        return node, list(cluster.node_tes.get(node, []))
    te = te or target_te(scenario, te_types)
    return te, [f"{t}/{scenario.part}" for t in target_tes(scenario, te, te_types)]


def placed_target(events: HealthEvents, config, model: str) -> tuple[str, str]:
    """scale-across: (the node the head placed `model`'s first TE on, that TE's
    id), from the head's first scale_decision that names a node."""
    placed = events.first_where(0.0, lambda e: e.get("event") == "scale_decision"
                                and (e.get("details") or {}).get("model") == model
                                and (e.get("details") or {}).get("placed"))
    if placed is None:
        raise RuntimeError(f"no scale-out of {model} placed on a node (the head's "
                           "scale_decision events name none)")
    [node] = placed["details"]["placed"]
    spec = next(m for m in config.models if m.name == model)
    return node, spec.te_id(0, node)


def wait_tes(url: str, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := num_tes(url) or 0) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health lists {n} TEs, want {want}, after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def model_dir(config) -> str:
    """The directory of the model the drill loads ([node] model, or a head's
    first [[model]])."""
    return config.model or (config.models[0].path if config.models else "")


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]
