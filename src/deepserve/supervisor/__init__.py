"""Per-node process management: start, watch and stop every process of a node."""
