"""What the launcher hands a TE's master and tokenizer processes (the
worker's is worker/spec.py): plain data, so the launcher builds them without
importing what the children run."""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.config import EngineConfig


@dataclass(frozen=True)
class MasterSpec:
    config: EngineConfig  # resolved
    ring_name: str
    ring_overflow: str
    requests_address: str
    steps_address: str
    tokenizer_address: str
    client_address: str
    pd_address: str  # peers' masters reach this one here: pd_address(the TE's inbox)
    te_id: str = "te"
    report_address: str | None = None  # the cluster manager's inbox, if any
    report_interval_s: float = 0.5
    tier_address: str = ""  # the node's KV tier service ("": no host / disk tier)
    cache_cost_model: bool = True  # [node] cache_cost_model


@dataclass(frozen=True)
class TokenizerSpec:
    config: EngineConfig  # resolved
    listen_address: str
    master_address: str
    client_address: str
    te_id: str = "te"
