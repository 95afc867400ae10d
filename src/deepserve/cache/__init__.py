"""Relational Tensor Cache (RTC) policy: block pool, prefix radix tree, block hashes.

Pure Python, no processes: the master drives it, workers only see block ids.
The tiers below the device (host DRAM, disk) are tiers/.
"""
