"""The master's side of the node's KV tiers (the service itself: deepserve.tiers).

coordinator.py decides, as a pure policy object: it admits requests (lookups,
loads) and hands write-through and contexts to writes.py, DualPath staging to
staging.py, layer-by-layer loads to layered.py; each is given what it shares
with the others (channel.py).
link.py holds the master's sockets to the tier service and carries the
coordinator's effects out.
"""
