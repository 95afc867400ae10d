"""Gang placement on one node: pure policy, no processes.

    place(placed, num_devices, te) -> Placement
        is_placed: start te now (after evicting `victims`, in order)
        victims:   TEs to stop first, each with the reason to log (`evicted`)
        reason:    why te stays down when it is refused (logged as `failed`)

A TE takes all its devices (tp) together or none. The rule:
- num_devices None: no limit, every TE is placed;
- enough devices free: placed, nobody evicted;
- else TEs of strictly lower priority are evicted, lowest priority first
  (start order among equals), and only until enough devices are free;
- if even evicting every lower-priority TE would not free enough, te is
  refused and nobody is evicted (equal or higher priority is never evicted).

The caller carries the decision out (node.py: terminate victims, log
`evicted` / `failed`, keep its list of placed TEs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Gang:
    """A TE as placement sees it: how many devices it needs, and its priority."""

    te_id: str
    num_devices: int
    priority: int = 0


@dataclass(frozen=True)
class Eviction:
    te_id: str
    num_devices: int
    reason: str


@dataclass(frozen=True)
class Placement:
    is_placed: bool
    victims: tuple[Eviction, ...] = ()
    reason: str = ""


def place(placed: Sequence[Gang], num_devices: int | None, te: Gang) -> Placement:
    """Decide whether `te` starts, given the TEs holding devices now (in start
    order) and the node's device count (None: no limit)."""
    if num_devices is None:
        return Placement(True)
    free = num_devices - sum(t.num_devices for t in placed)
    victims: list[Gang] = []
    for other in sorted((t for t in placed if t.priority < te.priority),
                        key=lambda t: t.priority):  # stable: start order among equals
        if free >= te.num_devices:
            break
        victims.append(other)
        free += other.num_devices
    if free < te.num_devices:
        return Placement(False, reason=(
            f"needs {te.num_devices} devices together; {free} of {num_devices} can be freed "
            f"(no lower-priority TE holds the rest): not started"))
    return Placement(True, tuple(
        Eviction(other.te_id, other.num_devices,
                 f"{te.te_id} (priority {te.priority}) needs {te.num_devices} devices "
                 f"together; {other.te_id} has priority {other.priority}")
        for other in victims))
