"""The caches a node keeps without a process of their own, pure Python:

- Relational Tensor Cache (RTC) policy: block pool, prefix radix tree, block
  hashes (kv_manager, radix_tree, block_hash). The master drives it, workers
  only see block ids. The tiers below the device (host DRAM, disk) and their
  service are tiers/.
- the node's weight cache (weight_cache): model files in tmpfs, shared by the
  supervisor that fills it and the workers that load from it.
"""
