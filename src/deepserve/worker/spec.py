"""WorkerSpec: what the launcher hands one worker process (worker_actor.py).

Its own module, free of torch: the launcher builds it in the TE server, which
imports no torch (only the forkserver its children fork from does).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.config import EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    run_id: str
    rank: int
    config: EngineConfig  # resolved: num_kv_blocks and max_model_len are set
    ring_name: str
    ring_overflow: str
    step_done_address: str
    dist_init_method: str
    te_id: str = "te"
    # the node's weight cache root; None: $DEEPSERVE_WEIGHT_CACHE of this process
    # (a forkserver child has the forkserver's environment, not the launcher's)
    weight_cache: str | None = None
    run_dir: str = ""
    """The TE's run directory (0700, swept when the TE is): the worker's one-host
    KV listeners (DistFlow receiver, layer streams) bind ipc:// paths in it."""
