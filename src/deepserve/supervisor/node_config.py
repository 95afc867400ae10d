"""A node's config as the supervisor sees it: the schema lives on floor 0
(deepserve/config/node.py) because every child reads it too; this module
keeps the names the node, the drills and the tools import."""

from __future__ import annotations

from msgspec.structs import replace

from deepserve.config.loading import load_node_config
from deepserve.config.node import NodeConfig, SupervisorConfig, TESpec

__all__ = ["NodeConfig", "SupervisorConfig", "TESpec", "load_node_config", "with_port"]


def with_port(config: NodeConfig, host: str | None, port: int | None) -> NodeConfig:
    """The command line's --host / --port over the file's."""
    node = replace(config.node, host=host or config.node.host, port=port or config.node.port)
    return replace(config, node=node)
