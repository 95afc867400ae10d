"""`python -m deepserve.drill SCENARIO` (bin/deepserve-drill): inject one fault
into a running node under streaming load and report what the clients saw.

    bin/deepserve-drill kill-worker                    # starts a node from conf/drill.toml
    bin/deepserve-drill hang-worker --mode stall --json out.json
    bin/deepserve-drill kill-master --url http://127.0.0.1:8000 \\
        --log-dir /tmp/ds-logs --drill-dir /tmp/ds-drill --conf conf/drill.toml
    bin/deepserve-drill kill-node                      # a head and two joined nodes
    bin/deepserve-drill scale-across                   # the same, TEs placed by the head
    bin/deepserve-drill kill-head                      # a head, a standby head, a node
    bin/deepserve-drill partition-head --json out.json # the same on 3 network namespaces
                                                       # (root), the heads' link cut

Without --url a node is started from --conf (supervisor.drill forced on, a
free port) and always stopped at the end, on errors and Ctrl-C too;
kill-node starts a cluster instead (drill/cluster.py: the head from --conf,
two nodes from conf/cluster-node.toml joined on 127.0.0.2 and 127.0.0.3) and
has no --url form; so does scale-across (conf/cluster-scaled-head.toml and
conf/cluster-scaled-node.toml: a head without devices, capacity-only nodes) and
kill-head (drill/cluster.py: HeadCluster; the head from --conf as a process on
127.0.0.1, this process's node a standby head on 127.0.0.2 from
conf/cluster-node.toml, whose gateway takes the load, n2 joined to both). With
--url the node is someone else's: --conf must describe it (deadlines, TE
types, model), --log-dir is its health log's folder (pids for signal
scenarios; the fault's proof, detection and recovery for all) and --drill-dir
its fault-hook folder (hook scenarios).

partition-head (drill/partition.py) starts its own three hosts and writes its
own report (sent, lost, bad_streams, served_twice, delivered_twice, late_tokens,
heads_at_end, proven, proof); --conf names the model only ([node] model, default
conf/cluster-head.toml's).

The drill itself is runner.py. Exit 0 only when the report is ok (nothing
lost, no bad stream, the fault proven to have happened); 1 when not; 2 when
the drill could not run.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
import urllib.error
from msgspec.structs import replace
from pathlib import Path

import click

from deepserve.drill.cluster import JOINERS
from deepserve.drill.partition import DESCRIPTION as PARTITION_DESCRIPTION, NAME as PARTITION
from deepserve.drill.report import DrillReport
from deepserve.drill.runner import run_drill
from deepserve.drill.target import served_model
from deepserve.drill.scenarios import SCENARIOS, get_scenario
from deepserve.ipc.sockets import free_port

log = logging.getLogger("deepserve.drill")

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONF = ROOT / "conf" / "drill.toml"
DRILL_DISK, DRILL_DISK_BYTES = ROOT / "var" / "drill-kvcache", 64 << 20
"""The disk tier of a node a disk drill starts itself, when its conf has none."""


def _describe(report: DrillReport) -> str:
    d = report.details
    lines = []
    if d.get("errors"):
        lines.append(f"failures by type: {d['errors']}")
    if d.get("bad"):
        lines.append("bad streams: " + "; ".join(f"#{i}: {why}" for i, why in
                                                 list(d["bad"].items())[:10]))
    if d.get("lost_ids"):
        lines.append(f"lost: {d['lost_ids'][:20]}")
    if d.get("no_service_s") is not None and report.scenario == "kill-head":
        lines.append(f"no service for {d['no_service_s']:.3f} s (the kill to the first token "
                     "of a request sent after it)")
    if "restarts" in d:
        lines.append(f"restarts: {len(d['restarts'])} {d['restarts']}; lost: {report.lost}; "
                     f"bad_streams: {report.bad_streams}")
    if d.get("poison"):
        lines.append(f"poison: {d['poison']}")
    if d.get("detected_event"):
        lines.append(f"detected by: {d['detected_event']}")
    if d.get("timeline"):
        lines.append("health log after the fault:")
        lines.extend(f"  {line}" for line in d["timeline"][:40])
    for note in d.get("notes") or ():
        lines.append(note)
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("scenario", required=False)
@click.option("--mode", type=click.Choice(["sigstop", "stall"]), default=None,
              help="hang-worker: SIGSTOP the worker (default) or the in-loop stall hook.")
@click.option("--url", default=None, help="A running node's gateway; default: start one.")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False),
              help="With --url: the folder of the node's health.jsonl (the fault's proof).")
@click.option("--drill-dir", default=None, type=click.Path(file_okay=False),
              help="With --url: the node's DEEPSERVE_DRILL_DIR (fault hooks).")
@click.option("--conf", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The node's config; default: the scenario's (conf/drill.toml, "
                   "conf/dualpath.toml for dualpath-de-fail).")
@click.option("--node-conf", default=None, type=click.Path(exists=True, dir_okay=False),
              help="kill-node, scale-across, kill-head: the joined nodes' config (default "
                   "conf/cluster-node.toml, conf/cluster-scaled-node.toml; kill-head: the "
                   "standby head's and n2's).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the report's JSON here.")
@click.option("--duration", default=10.0, show_default=True, type=float,
              help="Seconds of load at least (longer while recovery is awaited).")
@click.option("--concurrency", default=3, show_default=True, type=int)
@click.option("--max-tokens", default=16, show_default=True, type=int)
@click.option("--model", default=None, help="Model name for requests; default: the node's.")
@click.option("--warmup", default=2.0, show_default=True, type=float,
              help="Seconds of load before the fault.")
@click.option("--request-timeout", default=30.0, show_default=True, type=float,
              help="A request not ended after this (+5 s) counts as lost.")
@click.option("--te", default=None, help="Target TE (default te0; kv-transfer-fail: the "
              "first prefill TE).")
@click.option("--list", "list_", is_flag=True, help="List the scenarios and exit.")
@click.option("-v", "--verbose", is_flag=True)
def main(scenario, mode, url, log_dir, drill_dir, conf, node_conf, json_path, duration, concurrency,
         max_tokens, model, warmup, request_timeout, te, list_, verbose) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if list_ or scenario is None:
        for s in SCENARIOS.values():
            click.echo(f"{s.name:<18}{s.description}")
        click.echo(f"{PARTITION:<18}{PARTITION_DESCRIPTION}")
        raise SystemExit(0 if list_ else 2)
    if scenario == PARTITION:
        _partition(conf, json_path)
    try:
        chosen = get_scenario(scenario, mode)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SCENARIO") from None

    def on_term(signum, frame):
        raise KeyboardInterrupt  # the finally blocks stop the load and the node

    signal.signal(signal.SIGTERM, on_term)
    from deepserve.supervisor.node_config import load_node_config

    def echo(msg: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)

    node = cluster = None
    try:
        conf = conf or str(ROOT / "conf" / chosen.conf)
        config = load_node_config(conf, overrides=None if url else {"port": free_port()})
        if chosen.kills_node and url is not None:
            raise click.BadParameter(f"{chosen.name} starts a cluster of its own; no --url",
                                     param_hint="--url")
        if chosen.kills_head:
            from deepserve.drill.cluster import HeadCluster
            node_file = Path(node_conf) if node_conf else ROOT / "conf" / chosen.node_conf
            node = cluster = HeadCluster(Path(conf), drill_config(
                load_node_config(node_file), chosen), node_file)
            config = cluster.config
            echo(f"starting a cluster: head from {conf} on {cluster.head_address}, standby "
                 f"head on {cluster.url} (the load's gateway), node n2 joined to both"
                 + _keyed(cluster))
            cluster.start()
            url, log_dir, drill_dir = cluster.url, cluster.log_dir, cluster.drill_dir
        elif chosen.kills_node:
            from deepserve.drill.cluster import LocalCluster
            node = cluster = LocalCluster(drill_config(config, chosen), Path(node_conf)
                                          if node_conf else ROOT / "conf" / chosen.node_conf)
            config = cluster.config
            echo(f"starting a cluster: head from {conf} on {cluster.url}, nodes "
                 f"{', '.join(n for n, _ in JOINERS)}" + _keyed(cluster))
            cluster.start()
            url, log_dir, drill_dir = cluster.url, cluster.log_dir, cluster.drill_dir
        elif url is None:
            config, node = _drill_node(config, chosen)
            echo(f"starting a node from {conf} on {node.url}")
            node.start()  # assigned first: the finally below stops it even if this fails
            url = node.url
            log_dir = log_dir or getattr(node, "log_dir", None)
            drill_dir = drill_dir or getattr(node, "drill_dir", None)
        if model is None and node is None:
            try:
                model = served_model(url.rstrip("/"))
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
                model = None
        model = model or config.served_model or config.models[0].name  # a head: [[model]] only
        report = run_drill(chosen, url=url.rstrip("/"), model=model,
                           config=config, log_dir=log_dir, drill_dir=drill_dir,
                           duration_s=duration, concurrency=concurrency, max_tokens=max_tokens,
                           warmup_s=warmup, request_timeout_s=request_timeout, te=te,
                           echo=echo, cluster=cluster)
    except KeyboardInterrupt:
        echo("interrupted")
        raise SystemExit(130) from None
    except Exception as exc:  # noqa: BLE001 - the drill could not run: say why, exit 2
        echo(f"drill error: {type(exc).__name__}: {exc}")
        for name in cluster.nodes if cluster is not None else ():  # before stop() removes them
            echo(f"--- {name}'s output, its end:\n{cluster.tail(name, 2500)}")
        if verbose:
            raise
        raise SystemExit(2) from None
    finally:
        if node is not None:
            echo("stopping the node")
            node.stop()
    _print(report, json_path)
    raise SystemExit(0 if report.ok else 1)


def _keyed(cluster) -> str:
    return f", under keys of its own ({cluster.keys[1]})" if cluster.keys else ", without keys"


def _partition(conf: str | None, json_path: str | None) -> None:
    """partition-head: run, print, exit 0 (ok), 1 (not ok) or 2 (could not run)."""
    from deepserve.drill import partition
    from deepserve.drill.netns import NetnsUnavailable
    from deepserve.drill.target import model_dir
    from deepserve.supervisor.node_config import load_node_config
    echo = lambda msg: click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)  # noqa: E731
    try:
        model = model_dir(load_node_config(conf or ROOT / "conf" / "cluster-head.toml"))
        report = partition.run_partition(model, echo)
    except (NetnsUnavailable, RuntimeError, OSError, ValueError) as exc:
        echo(f"drill error: {type(exc).__name__}: {exc}")
        raise SystemExit(2) from None
    bad = report.pop("bad")
    text = json.dumps(report)
    click.echo(text)
    for prompt, why in bad.items():
        click.echo(f"bad stream {prompt!r}: {why}")
    if report["served_twice"]:
        click.echo(f"served twice: {report['served_twice']} request(s) generated on two "
                   f"attempts at once ({report['late_tokens']} tokens dropped at the gateway; "
                   f"delivered twice: {report['delivered_twice']})")
    if json_path:
        Path(json_path).write_text(text + "\n")
    raise SystemExit(0 if partition.ok(report) else 1)


def _drill_node(config, scenario=None):
    """A node of our own, drills on (and the scenario's [node] keys), not
    started yet; (its config, the node)."""
    from deepserve.supervisor.node import Node
    config = drill_config(config, scenario)
    return config, Node(config)


def drill_config(config, scenario=None):
    """The config a drill's own node runs: drills on, the scenario's [node] keys."""
    if hasattr(config, "supervisor"):
        config = replace(config, supervisor=replace(config.supervisor, drill=True))
    if scenario is not None and scenario.node_overrides:
        config = replace(config, node=replace(config.node, **dict(scenario.node_overrides)))
    if scenario is not None and scenario.needs_disk and not config.node.has_disk_tier:
        config = replace(config, node=replace(  # a disk tier (and the host tier it needs)
            config.node, disk_cache_dir=str(DRILL_DISK), disk_cache_bytes=DRILL_DISK_BYTES,
            host_cache_bytes=config.node.host_cache_bytes or DRILL_DISK_BYTES // 4))
    return config


def _print(report: DrillReport, json_path: str | None) -> None:
    click.echo(report.to_text())
    extra = _describe(report)
    if extra:
        click.echo(extra)
    if json_path:
        report.write_json(json_path)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
