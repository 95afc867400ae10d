"""Relational Tensor Cache (RTC) policy: block pool, prefix radix tree.

Pure Python, no processes: the master drives it, workers only see block ids.
"""
