"""A node's config as the supervisor sees it: the schema lives on floor 0
(deepserve/config/node.py) because every child reads it too; this module
keeps the names the node, the drills and the tools import."""

from __future__ import annotations

import msgspec
from msgspec.structs import replace

from deepserve.config.loading import load_node_config
from deepserve.config.models import ModelSpec, parse_model_arg
from deepserve.config.cluster import ClusterSection, named_for_cluster
from deepserve.config.node import NodeConfig, NodeSection, SupervisorConfig, TESpec

__all__ = ["NodeConfig", "SupervisorConfig", "TESpec", "load_node_config", "with_cluster",
           "with_models", "with_port", "with_quantize"]


def with_cluster(config: NodeConfig, join: str | None = None, host: str | None = None,
                 name: str | None = None, port: int | None = None,
                 standby: bool | None = None, keys: str | None = None) -> NodeConfig:
    """The command line's --join HOST:PORT[,HOST:PORT] / --cluster-host ADDR /
    --node-name / --cluster-port / --standby / --keys DIR over the file's
    [cluster] (checked as the file's; the rest of it, secure included, kept; a
    joining node's TEs are renamed after it)."""
    given = {"host": host, "port": port, "head": join, "standby": standby, "keys": keys}
    if name is None and all(v is None for v in given.values()):
        return config
    c = config.cluster
    derived = c.name == "" or c.name == ClusterSection(host=c.host).name
    fields = {**msgspec.structs.asdict(c), **{k: v for k, v in given.items() if v is not None},
              "name": name if name is not None else ("" if derived else c.name)}
    cluster = msgspec.convert(fields, ClusterSection)
    if cluster.joins and config.models and not cluster.standby:
        raise ValueError("--join: a joining node runs [[te]] TEs only; this file has "
                         "[[model]] tables (they scale on the head)")
    return replace(config, cluster=cluster, tes=named_for_cluster(config.tes, cluster))


def with_port(config: NodeConfig, host: str | None, port: int | None) -> NodeConfig:
    """The command line's --host / --port over the file's."""
    node = replace(config.node, host=host or config.node.host, port=port or config.node.port)
    return replace(config, node=node)


def with_models(config: NodeConfig, models: list[str] | tuple[str, ...] = (),
                idle_s: float | None = None) -> NodeConfig:
    """The command line's `--model [NAME=]DIR` (repeatable) and
    `--scale-to-zero-after SECONDS` over the file's models.

    --model: these models replace the [node] model and its [[te]] TEs; each
    is scalable (min_tes 1, max_tes 2) and its TEs take the first [[te]]
    table's engine options. --scale-to-zero-after alone makes the [node]
    model scalable (its [[te]] count becomes min_tes). Either sets idle_s of
    every model; [[model]] tables stay."""
    if not models and idle_s is None:
        return config
    options = dict(config.tes[0].options) if config.tes else {}
    if models:
        first = [ModelSpec(name=name, path=path, options=options)
                 for name, path in map(parse_model_arg, models)]
    elif config.tes:
        count = len(config.tes)
        first = [ModelSpec(name=config.node.served_model, path=config.node.model,
                           options=options, min_tes=count, max_tes=max(count, 2))]
    else:
        first = []
    every = [replace(m, idle_s=idle_s if idle_s is not None else m.idle_s)
             for m in first + list(config.models)]
    node = NodeSection(**{**{f: getattr(config.node, f) for f in config.node.__struct_fields__},
                          "model": "", "served_model": ""})
    return replace(config, node=node, tes=(), models=tuple(every))


def with_quantize(config: NodeConfig, mode: str | None) -> NodeConfig:
    """The command line's `--quantize MODE` over every TE's and every model's
    engine options (checked as a [[te]] key would be: EngineConfig)."""
    if mode is None:
        return config
    tes = tuple(replace(te, options={**te.options, "quantize": mode}) for te in config.tes)
    models = tuple(replace(m, options={**m.options, "quantize": mode}) for m in config.models)
    for te in tes:  # ValueError naming quantize (a bad mode, a float32 TE)
        te.engine_config(config.node.model or "-")
    for model in models:
        model.engine_config()
    return replace(config, tes=tes, models=models)
