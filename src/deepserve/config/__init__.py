"""Configuration, floor 0: every process reads its config from here.

    engine.py   EngineConfig (one TE) and load_config for [engine] files
    node.py     the node's schema: one msgspec Struct per TOML section, NodeConfig
    loading.py  load_node_config (TOML -> NodeConfig), the resolved file children read
    child.py    the command line of node-level children: --conf PATH --role NAME
"""

from deepserve.config.engine import EngineConfig, load_config
from deepserve.config.loading import load_node_config, read_run_config, write_run_config
from deepserve.config.node import (GatewaySection, NodeConfig, NodeSection, PDOptions,
                                   RouterSection, RunAddresses, SupervisorConfig, TESection,
                                   TESpec)

__all__ = ["EngineConfig", "GatewaySection", "NodeConfig", "NodeSection", "PDOptions",
           "RouterSection", "RunAddresses", "SupervisorConfig", "TESection", "TESpec",
           "load_config", "load_node_config", "read_run_config", "write_run_config"]
