"""The KV tier service's settings, from the run's config file (tier_server.py
is the service): where it listens, its pools' budgets per model key, and, on
many hosts, where other hosts' tier services reach it (the remote tier)."""

from __future__ import annotations

import msgspec

from deepserve.config.loading import read_run_config


class TierSettings(msgspec.Struct, frozen=True, kw_only=True):
    inbox: str
    cm: str = ""
    run_id: str = "kvc"
    host_bytes: int = 0
    """Per model key."""
    disk_dir: str = ""
    disk_bytes: int = 0
    """Per model key (0: no disk tier)."""
    pin_bytes: int = 0
    """Per model key (0: half of its lowest persistent tier)."""
    fsync: str = "never"
    scrub_bytes_per_s: int = 0
    """Block files re-read per second ([node] disk_scrub_bytes_per_s; 0: no scrub)."""
    lease_s: float = 30.0
    peer: str = ""
    """This service's tcp address for other hosts' (the remote tier); "": one host."""
    cm_pub: str = ""
    """The CM's PUB: the other hosts' TierReports name their tier services."""


def load_settings(args) -> TierSettings:
    config, run = read_run_config(args.conf)
    node = config.node
    n = max(1, len(config.all_models))
    return TierSettings(inbox=run.kv_cache, cm=run.cm, run_id=args.run_id or "kvc",
                        host_bytes=node.host_cache_bytes // n, disk_dir=node.disk_cache_dir,
                        disk_bytes=node.disk_cache_bytes // n,
                        pin_bytes=node.context_cache_bytes // n, fsync=node.disk_fsync,
                        scrub_bytes_per_s=node.disk_scrub_bytes_per_s,
                        peer=run.kv_peer, cm_pub=run.cm_pub if run.kv_peer else "")
