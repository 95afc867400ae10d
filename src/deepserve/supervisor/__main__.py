"""`python -m deepserve.supervisor --conf conf/node.toml [--host H] [--port P]
[--model [NAME=]DIR ...] [--scale-to-zero-after SECONDS]
[--cluster-host ADDR] [--join HEAD:PORT[,STANDBY:PORT]] [--node-name NAME] [--standby]`:
start a node, print how to call it, serve until Ctrl-C or SIGTERM. The
node's supervisor restarts what fails; a gateway, job executor or cluster
manager that crash-loops stops the node. With --join the node adds its
[[te]] TEs to the head's cluster and runs nothing else ([cluster], README);
with --standby also a gateway, and the head's control once the head dies."""

from __future__ import annotations

import os
import sys
import time

import click

from deepserve.actor import ActorLife
from deepserve.config.models import is_gguf
from deepserve.errors import ModelLoadError
from deepserve.ipc import curve_keys
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import (load_node_config, with_cluster, with_models,
                                              with_port, with_quantize)

_VITAL = ("gateway", "job-executor", "cluster-manager")


def _usage(node: Node) -> str:
    if node.joins and node.standby:
        c = node.config.cluster
        return (f"DeepServe standby head {c.name} ({c.host}) joined the cluster at {c.head}; "
                f"its gateway is up at {node.url} and it takes over the cluster manager and "
                f"job executor after {c.failover_s:g} s without the head. Ctrl-C stops it.")
    if node.joins:
        c = node.config.cluster
        tes = (f"TEs {', '.join(node.te_ids)} are listed" if node.te_ids else
               "no TE of its own: the head's autoscaler places scaled TEs here")
        return (f"DeepServe node {c.name} ({c.host}) joined the cluster at {c.head}: "
                f"{tes}. Ctrl-C stops them.")
    names = list(node.config.served_models)
    model = names[0]
    return f"""DeepServe is up at {node.url}  ({len(node.te_ids)} TEs; models {', '.join(names)})

  curl {node.url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

  from openai import OpenAI
  client = OpenAI(base_url="{node.url}/v1", api_key="unused")
  print(client.chat.completions.create(model="{model}", max_tokens=32,
        messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)

Ctrl-C stops every process."""


@click.command()
@click.option("--conf", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--host", default=None, help="overrides [node] host")
@click.option("--port", default=None, type=int, help="overrides [node] port")
@click.option("--model", "models", multiple=True, metavar="[NAME=]DIR|FILE.gguf",
              help="serve this Hugging Face model directory or GGUF file (repeatable; "
                   "replaces [node] model)")
@click.option("--scale-to-zero-after", "idle_s", default=None,
              type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="every model goes to zero TEs after this long without a request")
@click.option("--cluster-host", default=None, metavar="ADDR",
              help="overrides [cluster] host: this host's address for cross-host sockets")
@click.option("--join", default=None, metavar="HOST:PORT[,HOST:PORT...]",
              help="overrides [cluster] head: join that head's cluster with this node's TEs "
                   "(several: the head, then its standby heads)")
@click.option("--node-name", default=None, help="overrides [cluster] name (prefix of TE ids)")
@click.option("--standby", is_flag=True, default=None,
              help="sets [cluster] standby: this joining node also runs a gateway and takes "
                   "over the head's cluster manager and job executor if the head dies")
@click.option("--cluster-port", default=None, type=int,
              help="overrides [cluster] port (this node's first TCP port)")
@click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "gguf"]),
              help="quantize every TE's bf16 weights at load, or gguf: keep a GGUF "
                   "model's own quantized weights (sets [[te]] / [[model]] quantize)")
@click.option("--keys", default=None, metavar="DIR",
              help="overrides [cluster] keys: the directory of bin/deepserve-keys' files")
def main(conf: str, host: str | None, port: int | None, models: tuple[str, ...],
         idle_s: float | None, cluster_host: str | None, join: str | None,
         node_name: str | None, cluster_port: int | None, standby: bool | None,
         quantize: str | None, keys: str | None) -> None:
    for value in models:
        path = value.partition("=")[2] if "=" in value else value
        if not (os.path.isfile(os.path.join(path, "config.json"))
                or (is_gguf(path) and os.path.isfile(path))):
            raise click.BadParameter(f"{path!r} is not a model directory (no config.json) "
                                     "nor a .gguf file", param_hint="--model")
    try:
        config = with_models(with_port(load_node_config(conf), host, port), models, idle_s)
        config = with_quantize(config, quantize)
        config = with_cluster(config, join, cluster_host, node_name, cluster_port, standby,
                              keys)
    except ValueError as e:  # names the file, the section and the key
        raise click.UsageError(str(e)) from None
    life = ActorLife("node")  # SIGTERM / SIGINT only set its flag
    try:
        node = Node(config)
    except curve_keys.KeysError as e:  # [cluster] secure without usable keys
        life.close()
        raise click.UsageError(str(e)) from None
    except ModelLoadError as e:  # a .gguf model that cannot be imported
        life.close()
        raise click.ClickException(str(e)) from None
    status = {"code": 0}

    vital = set(_VITAL) if not node.joins or node.standby else set()

    def watch() -> bool:
        failed = sorted(node.supervisor.failed & vital)
        if failed:  # restarted until it crash-looped
            click.echo(f"node: {', '.join(failed)} failed for good; stopping", err=True)
            status["code"] = 1
            return False
        time.sleep(0.3)
        return True

    try:
        try:
            node.start()
        except (RuntimeError, TimeoutError) as e:  # not healthy in time, refused, a death
            click.echo(f"node: not started: {e}", err=True)
            raise SystemExit(1) from None  # after the finally: every child stopped
        click.echo(_usage(node), err=False)
        sys.stdout.flush()
        life.run(watch, lambda: {})
    finally:
        node.stop()
        life.close()
    raise SystemExit(status["code"])


if __name__ == "__main__":
    main()
