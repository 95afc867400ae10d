"""The master's side of the node's KV tiers (the service itself: deepserve.tiers).

coordinator.py decides (lookups, loads, write-through, contexts, DualPath
staging), as a pure policy object; link.py holds the master's sockets to the
tier service and carries the coordinator's effects out.
"""
