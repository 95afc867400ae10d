"""`python -m deepserve.chaos` (bin/deepserve-chaos): a seeded mixed workload
through a node's gateway while a seeded schedule of drill faults hits it;
every request checked against a greedy oracle, every fault proven.

    bin/deepserve-chaos --duration 30m --seed 7 --json out.json --png out.png
    bin/deepserve-chaos --duration 90 --seed 3 --faults kill-je,slow-worker --fault-every 20

The node is started here from --conf (default conf/chaos.toml; drills forced
on, a free port), as the drills start theirs (drill/__main__.py), and always
stopped at the end, on errors and Ctrl-C too; then its shared memory must be
gone (the report says so). Exit 0 only when nothing was lost, no stream was
bad, no hostile request was accepted, every fault was proven and /dev/shm is
back to its baseline; 1 when not; 2 when the run could not run.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import click

from deepserve.chaos import report as chaos_report
from deepserve.chaos.resources import growth, growth_after_s, shm_names
from deepserve.chaos.schedule import fault_menu, make_schedule, not_supported, parse_duration
from deepserve.ipc.segments import unlink_segment

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONF = ROOT / "conf" / "chaos.toml"


def _duration(ctx, param, value) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--duration", default="30m", show_default=True, callback=_duration,
              help="Load duration: seconds, or with a unit (90s, 30m, 1h).")
@click.option("--seed", required=True, type=int, help="Seeds the workload and the faults.")
@click.option("--conf", default=str(DEFAULT_CONF), show_default=True,
              type=click.Path(exists=True, dir_okay=False), help="The node's config.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the report here.")
@click.option("--png", "png_path", default=None, type=click.Path(dir_okay=False),
              help="Draw the timeline here (matplotlib).")
@click.option("--fault-every", default=None, type=click.FloatRange(min=1.0),
              help="Seconds between faults; default: uniform 30-60 s from the seed.")
@click.option("--faults", default=None, help="Comma-separated scenarios to draw from "
              "(default: every one that applies to the node).")
@click.option("--concurrency", default=3, show_default=True, type=click.IntRange(1, 64))
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1, 4096))
@click.option("--request-timeout", default=60.0, show_default=True, type=float,
              help="A request not ended after this (+5 s) counts as lost.")
@click.option("--sample-every", default=10.0, show_default=True, type=float,
              help="Seconds between resource samples.")
@click.option("-v", "--verbose", is_flag=True)
def main(duration, seed, conf, json_path, png_path, fault_every, faults, concurrency,
         max_tokens, request_timeout, sample_every, verbose) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def echo(msg: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt  # the finally below stops the node

    signal.signal(signal.SIGTERM, on_term)
    from deepserve.drill.__main__ import drill_config
    from deepserve.ipc.sockets import free_port
    from deepserve.supervisor.node_config import load_node_config

    config = drill_config(load_node_config(conf, overrides={"port": free_port()}))
    te_types = {spec.te_id: spec.te_type for spec in config.tes}
    try:
        menu = fault_menu(te_types, faults.split(",") if faults else None,
                          has_host_tier=config.node.host_cache_bytes > 0,
                          has_disk_tier=config.node.has_disk_tier)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--faults") from None
    tes = [te for te, kind in te_types.items() if kind == "colocated"] or list(te_types)
    schedule = make_schedule(seed, duration, menu, tes, fault_every)
    echo(f"seed {seed}: {len(schedule)} faults in {duration:.0f} s from "
         f"{', '.join(menu)}")
    try:
        report = _run(config, seed, duration, schedule, concurrency, max_tokens,
                      request_timeout, sample_every, echo)
    except KeyboardInterrupt:
        echo("interrupted")
        raise SystemExit(130) from None
    except Exception as exc:  # noqa: BLE001 - the run could not run: say why, exit 2
        echo(f"chaos error: {type(exc).__name__}: {exc}")
        if verbose:
            raise
        raise SystemExit(2) from None
    report.update(seed=seed, conf=str(conf), menu=menu,
                  not_supported=not_supported(config.node.host_cache_bytes > 0,
                                              config.node.has_disk_tier),
                  schedule=[f.to_dict() for f in schedule])
    report["ok"] = chaos_report.is_ok(report) and report["shm"]["back_to_baseline"]
    click.echo(chaos_report.to_text(report))
    if json_path:
        chaos_report.write_json(report, json_path)
    if png_path:
        try:
            from deepserve.chaos.timeline import plot
            plot(report, png_path)
        except ImportError as exc:
            echo(f"no PNG: {exc}")
    raise SystemExit(0 if report["ok"] else 1)


def _run(config, seed, duration, schedule, concurrency, max_tokens, request_timeout,
         sample_every, echo) -> dict:
    import os

    from deepserve.chaos.runner import ChaosRun
    from deepserve.chaos.workload import Workload
    from deepserve.drill.health_events import HealthEvents
    from deepserve.drill.prompts import make_prompts, token_counter
    from deepserve.supervisor.node import Node

    node = Node(config)
    prefixes = [f"deepserve-{node.run_id}", f"deepserve-w{node.run_id}"]
    echo(f"starting a node on {node.url}")
    try:
        node.start()
        keys = config.gateway.api_keys
        tenants = sorted(keys, key=lambda k: keys[k]) or [None]
        pd = config.router.pd_policy is not None
        prompts = make_prompts(config.router.pd_options.min_prompt_len if pd else None,
                               token_counter(config.model))
        scaled = next((m.name for m in config.models if m.idle_s is not None), None)
        workload = Workload(seed, config.served_model, prompts, tenants, max_tokens,
                            scaled_model=scaled)
        run = ChaosRun(url=node.url, config=config, log_dir=node.log_dir,
                       drill_dir=node.drill_dir, workload=workload, schedule=schedule,
                       duration_s=duration, concurrency=concurrency,
                       request_timeout_s=request_timeout, sample_every_s=sample_every,
                       root_pid=os.getpid(), shm_prefixes=prefixes,
                       names=lambda: {p.pid: name for name, p in node.procs.items()}, echo=echo)
        run.prepare(config.node.startup_timeout_s)
        echo(f"load for {duration:.0f} s, {len(schedule)} faults")
        report = run.run()
        if scaled is not None:
            report["scaling"] = scaling_of(scaled, HealthEvents(node.log_dir).events())
    finally:
        echo("stopping the node")
        node.stop()
    left = shm_names(prefixes)
    for name in left:  # what the node's own sweep missed: reported, then removed
        unlink_segment(name)
    report["shm"] = {"prefixes": prefixes, "left_at_end": left, "back_to_baseline": not left}
    samples = run.sampler.samples()
    after = growth_after_s(duration)
    report["resources"].update(interval_s=sample_every, growth_after_s=after,
                               growth=growth(samples, after) if samples else {})
    return report


def scaling_of(model: str, events: list[dict]) -> dict:
    """The model's scale decisions (health log): to zero is an idle scale-in (the
    autoscaler takes every TE of an idle model), from zero a demand_from_zero scale-out."""
    mine = [e["details"] for e in events if e.get("event") == "scale_decision"
            and e.get("details", {}).get("model") == model]
    return {"model": model, "decisions": len(mine),
            "to_zero": sum(d.get("direction") == "in" and d.get("reason") == "idle"
                           for d in mine),
            "from_zero": sum(d.get("direction") == "out" and d.get("reason") == "demand_from_zero"
                             for d in mine)}


if __name__ == "__main__":
    main()
