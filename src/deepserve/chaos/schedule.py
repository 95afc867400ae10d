"""The chaos run's fault schedule: which drill scenario hits what, and when.
Pure: the same seed, duration and menu give the same schedule.

    seed ──random.Random──> gap (--fault-every, or uniform GAP_S) ──> fault at t
                            scenario: uniform from the menu
                            TE:       uniform from the colocated TEs (TE faults)
    t += gap, until END_MARGIN_S before the end

Faults are not serialised: one may land while an earlier one is still being
detected or recovered (overlap is the point). The menu is the drill
scenarios that apply to one node (SINGLE_NODE), less those the node's config
cannot host (kv-transfer-fail needs a prefill TE). What the drill package has
no scenario for is listed as not supported (the report says so).
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

SINGLE_NODE = ("kill-worker", "kill-master", "kill-tokenizer", "hang-worker", "stall-worker",
               "slow-worker", "drop-cache", "poison", "kill-cm", "kill-je", "kill-kv-tier",
               "kill-gateway", "kv-transfer-fail", "disk-full", "corrupt-disk")
"""Drill scenarios (drill/scenarios.py) that run against one node."""
NOT_SUPPORTED = {
    "kill-node": "needs a cluster of nodes (drill/cluster.py), not one node",
    "dualpath-de-fail": "needs conf/dualpath.toml's DualPath decode TE",
}
NEEDS_TE_TYPE = {"kv-transfer-fail": "prefill"}
GAP_S = (30.0, 60.0)
"""Seconds between two faults when --fault-every is not given: uniform in this range."""
END_MARGIN_S = 15.0
"""No fault starts this close to the end (the run still waits for open ones)."""

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | float | int) -> float:
    """Seconds from "90", "90s", "30m", "1.5h" (a number alone is seconds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _DURATION.match(str(text).lower())
        if match is None:
            raise ValueError(f"not a duration: {text!r} (seconds, or a number with s, m or h)")
        value = float(match.group(1)) * _UNIT_S[match.group(2)]
    if value <= 0:
        raise ValueError(f"a duration must be positive, not {text!r}")
    return value


@dataclass(frozen=True)
class PlannedFault:
    at_s: float
    """Seconds after the load started."""
    scenario: str
    te: str | None
    """The target TE; None: the scenario's own choice (node processes, te_type, every TE)."""

    def to_dict(self) -> dict:
        return asdict(self)


NEEDS_HOST_TIER = {"kill-kv-tier": "drawn on a node with a host KV tier (its tier service)"}
NEEDS_NO_HOST_TIER = {"drop-cache": "its proof (the cache probe misses right after the drop) "
                                    "cannot be shown with a host KV tier: the probe's blocks "
                                    "may come back from the tier"}


NEEDS_DISK_TIER = {s: "drawn on a node with a disk KV tier ([node] disk_cache_dir)"
                   for s in ("disk-full", "corrupt-disk")}


def not_supported(has_host_tier: bool, has_disk_tier: bool = False) -> dict[str, str]:
    """Scenario -> why a chaos run on this node does not draw it."""
    return {**NOT_SUPPORTED, **(NEEDS_NO_HOST_TIER if has_host_tier else NEEDS_HOST_TIER),
            **({} if has_disk_tier else NEEDS_DISK_TIER)}


def fault_menu(te_types: dict[str, str], only: list[str] | None = None,
               has_host_tier: bool = False, has_disk_tier: bool = False) -> list[str]:
    """The scenarios a node with these TEs (te id -> type) can take, in
    SINGLE_NODE order; `only` narrows it (unknown or inapplicable names: ValueError)."""
    kinds = set(te_types.values())
    menu = [s for s in SINGLE_NODE if (s not in NEEDS_TE_TYPE or NEEDS_TE_TYPE[s] in kinds)
            and not (has_host_tier and s in NEEDS_NO_HOST_TIER)
            and (has_host_tier or s not in NEEDS_HOST_TIER)
            and (has_disk_tier or s not in NEEDS_DISK_TIER)]
    if only is None:
        return menu
    bad = [s for s in only if s not in menu]
    if bad:
        raise ValueError(f"not applicable to this node: {', '.join(bad)} "
                         f"(the menu: {', '.join(menu)})")
    return [s for s in menu if s in only]


def make_schedule(seed: int, duration_s: float, menu: list[str], tes: list[str],
                  fault_every_s: float | None = None, first_at_s: float | None = None,
                  end_margin_s: float = END_MARGIN_S) -> list[PlannedFault]:
    """The faults of a run, by time. tes: the TEs a TE-level fault may hit
    (the colocated ones); first_at_s: the first fault's time (default: one
    gap in); fault_every_s: a fixed gap (default: uniform in GAP_S)."""
    if not menu:
        raise ValueError("no fault scenario applies")
    rng = random.Random(seed)

    def gap() -> float:
        return fault_every_s if fault_every_s is not None else rng.uniform(*GAP_S)

    faults: list[PlannedFault] = []
    t = first_at_s if first_at_s is not None else gap()
    while t <= duration_s - end_margin_s:
        scenario = rng.choice(menu)
        te = rng.choice(tes) if tes and scenario not in _CHOOSES_OWN_TE else None
        faults.append(PlannedFault(round(t, 3), scenario, te))
        t += gap()
    return faults


_CHOOSES_OWN_TE = frozenset({"kill-cm", "kill-je", "kill-kv-tier", "kill-gateway",
                             "disk-full", "corrupt-disk", "kv-transfer-fail"})
"""Node processes (and the disk tier), and a fault whose TE is the first of a type."""
