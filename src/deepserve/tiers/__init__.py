"""The node's KV tier service (floor 2): host DRAM pools and disk block files
below every TE's device pool, their index, the fetch-or-recompute cost model
and the storage token bucket.

The service runs as a process of its own (tier_server.py); the engine's
side of it (lookups, loads, write-through) is engine/tiers/coordinator.py, and a worker's
block copies are worker/cache_executor.py. cache/ keeps the pure policy.
"""
