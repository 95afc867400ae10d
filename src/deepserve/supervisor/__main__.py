"""`python -m deepserve.supervisor --conf conf/node.toml [--host H] [--port P]
[--model [NAME=]DIR ...] [--scale-to-zero-after SECONDS]`:
start a node, print how to call it, serve until Ctrl-C or SIGTERM. The
node's supervisor restarts what fails; a gateway, job executor or cluster
manager that crash-loops stops the node."""

from __future__ import annotations

import os
import sys
import time

import click

from deepserve.actor import ActorLife
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import load_node_config, with_models, with_port

_VITAL = ("gateway", "job-executor", "cluster-manager")


def _usage(node: Node) -> str:
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
@click.option("--model", "models", multiple=True, metavar="[NAME=]DIR",
              help="serve this Hugging Face model directory (repeatable; replaces [node] model)")
@click.option("--scale-to-zero-after", "idle_s", default=None,
              type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="every model goes to zero TEs after this long without a request")
def main(conf: str, host: str | None, port: int | None, models: tuple[str, ...],
         idle_s: float | None) -> None:
    for value in models:
        path = value.partition("=")[2] if "=" in value else value
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise click.BadParameter(f"{path!r} is not a model directory (no config.json)",
                                     param_hint="--model")
    try:
        config = with_models(with_port(load_node_config(conf), host, port), models, idle_s)
    except ValueError as e:  # names the file, the section and the key
        raise click.UsageError(str(e)) from None
    life = ActorLife("node")  # SIGTERM / SIGINT only set its flag
    node = Node(config)
    status = {"code": 0}

    def watch() -> bool:
        failed = sorted(node.supervisor.failed & set(_VITAL))
        if failed:  # restarted until it crash-looped
            click.echo(f"node: {', '.join(failed)} failed for good; stopping", err=True)
            status["code"] = 1
            return False
        time.sleep(0.3)
        return True

    try:
        node.start()
        click.echo(_usage(node), err=False)
        sys.stdout.flush()
        life.run(watch, lambda: {})
    finally:
        node.stop()
        life.close()
    raise SystemExit(status["code"])


if __name__ == "__main__":
    main()
