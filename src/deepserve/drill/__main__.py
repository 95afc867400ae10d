"""`python -m deepserve.drill SCENARIO` (bin/deepserve-drill): inject one fault
into a running node under streaming load and report what the clients saw.

    bin/deepserve-drill kill-worker                    # starts a node from conf/drill.toml
    bin/deepserve-drill hang-worker --mode stall --json out.json
    bin/deepserve-drill kill-master --url http://127.0.0.1:8000 \\
        --log-dir /tmp/ds-logs --drill-dir /tmp/ds-drill --conf conf/drill.toml

Without --url a node is started from --conf (supervisor.drill forced on, a
free port) and always stopped at the end, on errors and Ctrl-C too. With
--url the node is someone else's: --conf must describe it (deadlines, TE
types, model), --log-dir is its health log's folder (signal scenarios find
pids there; detection and recovery are read from it) and --drill-dir its
fault-hook folder (hook scenarios).

Flow: wait until /health lists every TE (and the target component has a pid)
-> reference: each prompt once, greedy -> load in a thread -> warm-up ->
inject -> wait for recovery (restarting scenarios: the TE's "recovered" event;
the others: the fault consumed / lifted and a request completed after it),
at most RECOVERY_BOUND = 6 x the largest deadline + 30 s after the fault, and
at least --duration of load in all -> a few settle seconds of load after
recovery -> stop load -> report (drill/report.py). Exit 0 only when the report
is ok (nothing lost, no bad stream); 1 when not; 2 when the drill could not run.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import click

from deepserve.drill.load import COMPLETED, LoadDriver, RequestRecord, first_success_after, now
from deepserve.drill.report import DrillReport, build_report
from deepserve.drill.scenarios import (DETECT_EVENTS, RECOVERED, SCENARIOS, HealthEvents,
                                       Injection, Scenario, deadline_of, get_scenario,
                                       target_te, wait_pid)
from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import num_tes

log = logging.getLogger("deepserve.drill")

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONF = ROOT / "conf" / "drill.toml"

SHORT_PROMPTS = ("Say hi", "The capital of France is", "1, 2, 3, 4,")
LONG_UNIT = "def handler(request):\n    headers = request.headers\n    return headers\n"
POLL_S = 0.2


def recovery_bound_s(supervisor) -> float:
    """How long after the fault the drill waits for recovery at most."""
    deadlines = [getattr(supervisor, "heartbeat_deadline_s", 3.0),
                 getattr(supervisor, "progress_deadline_s", 5.0)]
    return 6 * max(deadlines) + 30


def make_prompts(min_long_tokens: int | None, count_tokens=None) -> list[str]:
    """Three short prompts and three long ones, longer than `min_long_tokens`
    (the PD threshold) so they go disaggregated where the node has a 1P1D pair.
    count_tokens(text) -> int when the model's tokenizer is at hand; without it
    a token is assumed to cover up to 6 characters."""
    need = (min_long_tokens or 64) + 16
    long_prompts = []
    for i, topic in enumerate(("headers", "cookies", "query")):
        unit = LONG_UNIT.replace("headers", topic)
        text = f"# module {i}\n"
        while (count_tokens(text) if count_tokens else len(text) // 6) <= need:
            text += unit
        long_prompts.append(text)
    # interleaved: with concurrency 3 round robin, every wave has both kinds
    return [p for pair in zip(SHORT_PROMPTS, long_prompts) for p in pair]


def token_counter(model_dir: str):
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - fall back to characters
        return None
    return lambda text: len(tok.encode(text).ids)


def wait_tes(url: str, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := num_tes(url)) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health lists {n} TEs, want {want}, after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]



def run_drill(scenario: Scenario, *, url: str, model: str, config=None,
              log_dir: str | Path | None = None, drill_dir: str | Path | None = None,
              duration_s: float = 10.0, concurrency: int = 3, max_tokens: int = 16,
              warmup_s: float = 2.0, settle_s: float = 2.0, request_timeout_s: float = 30.0,
              prompts: list[str] | None = None, te: str | None = None,
              echo=lambda msg: None) -> DrillReport:
    """One drill against the node at `url`. config: its NodeConfig (TE types,
    supervisor deadlines, PD threshold); None: the health log's details and the
    supervisor defaults. te: the target TE (default: te0, or the first TE of the
    scenario's te_type). The report's details hold what the 9 keys do not."""
    supervisor = getattr(config, "supervisor", None)
    events = HealthEvents(log_dir) if log_dir is not None else None
    if config is not None:
        te_types = {te.te_id: te.te_type for te in config.tes}
    else:
        te_types = events.te_types() if events is not None else {}
    te = te or target_te(scenario, te_types)
    component = f"{te}/{scenario.part}"
    deadline_s = deadline_of(scenario, supervisor)
    bound_s = recovery_bound_s(supervisor)
    if scenario.restarts and events is None:
        raise RuntimeError(f"{scenario.name}: detection and recovery come from the health log: "
                           "give --log-dir")
    if prompts is None:
        min_len = (config.pd_options or {}).get("min_prompt_len") if config is not None else None
        prompts = make_prompts(min_len, token_counter(config.model) if config else None)

    echo(f"drill {scenario.name}: {scenario.description}; target {component}")
    wait_tes(url, len(config.tes) if config is not None else 1, bound_s)
    if scenario.is_signal:
        wait_pid(events, component, bound_s)
    driver = LoadDriver(url, model, prompts=prompts, concurrency=concurrency,
                        max_tokens=max_tokens, request_timeout_s=request_timeout_s)
    reference = driver.reference_sync()

    result: dict = {}

    def load() -> None:
        try:
            result["records"] = driver.run_sync()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            result["error"] = exc

    injection = Injection(scenario, te, component)
    thread = threading.Thread(target=load, name="drill-load", daemon=True)
    load_start = now()
    thread.start()
    detected: dict | None = None
    recovered_event: dict | None = None
    gave_up: dict | None = None
    consumed_at: float | None = None
    try:
        time.sleep(warmup_s)
        fault_at = injection.inject(events, drill_dir)
        echo(f"fault injected at {fault_at:.3f} ({scenario.fault} -> {component}"
             f"{f', pid {injection.pid}' if injection.pid else ''})")
        done_at: float | None = None
        while thread.is_alive():
            t = now()
            if events is not None:
                if detected is None:
                    detected = events.first(fault_at, DETECT_EVENTS, te)
                    if detected is not None:
                        echo(f"detected: {detected['component']} {detected['event']} "
                             f"after {detected['t'] - fault_at:.3f} s")
                        if scenario.fault == "stall":
                            injection.lift()  # or the replacement worker stalls too
                if recovered_event is None and scenario.restarts:
                    recovered_event = events.first(fault_at, {RECOVERED}, te)
                    if recovered_event is not None:
                        echo(f"recovered: {recovered_event['component']} after "
                             f"{recovered_event['t'] - fault_at:.3f} s")
                if gave_up is None:
                    gave_up = events.first(fault_at, {"failed"}, te)
                    if gave_up is not None:
                        echo(f"the supervisor gave up on {gave_up['component']}")
            if done_at is None:
                if scenario.restarts:
                    if recovered_event is not None or gave_up is not None:
                        done_at = t
                elif scenario.hold_s:  # slow: lift after hold_s, then one success after
                    if injection.lifted_at is None and t >= fault_at + scenario.hold_s:
                        injection.lift()
                        injection.lifted_at = injection.lifted_at or t
                    if (injection.lifted_at is not None
                            and first_success_after(list(driver.records), injection.lifted_at)):
                        done_at = t
                else:  # one-shot hooks: consumed, then one success after that
                    if consumed_at is None and injection.hook_consumed():
                        consumed_at = t
                    if consumed_at is not None and first_success_after(list(driver.records),
                                                                       consumed_at):
                        done_at = t
            if t >= fault_at + bound_s:
                echo(f"no recovery within {bound_s:.0f} s of the fault")
                break
            if done_at is not None and t >= done_at + settle_s and t >= load_start + duration_s:
                break
            time.sleep(POLL_S)
    finally:
        injection.cleanup()
        driver.stop()
        thread.join()
    if "error" in result:
        raise RuntimeError(f"load failed: {result['error']!r}") from result["error"]
    records: list[RequestRecord] = result["records"]
    if events is not None and detected is None:  # a last look: logged while load drained
        detected = events.first(fault_at, DETECT_EVENTS, te)
    if scenario.restarts:
        if recovered_event is None and events is not None:
            recovered_event = events.first(fault_at, {RECOVERED}, te)
        recovered_at = recovered_event["t"] if recovered_event is not None else None
    else:
        recovered_at = first_success_after(records, fault_at)
    report = build_report(scenario.name, records, reference, deadline_s, fault_at,
                          detected["t"] if detected else None, recovered_at)
    report.details.update(
        te=te, component=component, pid=injection.pid, hook=str(injection.hook or ""),
        detected_event=detected and {k: detected.get(k) for k in ("component", "event", "time")},
        recovered_event=recovered_event is not None, gave_up=gave_up is not None,
        hook_consumed=consumed_at is not None, notes=injection.notes,
        completed_after_fault=sum(1 for r in records
                                  if r.status == COMPLETED and r.start > fault_at),
        timeline=[f"+{e['t'] - fault_at:.3f} {e.get('component')} {e.get('event')} "
                  f"pid={e.get('pid')} {json.dumps(e.get('details') or {})}"
                  for e in (events.events(fault_at) if events is not None else [])])
    return report


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
              help="With --url: the folder of the node's health.jsonl.")
@click.option("--drill-dir", default=None, type=click.Path(file_okay=False),
              help="With --url: the node's DEEPSERVE_DRILL_DIR (fault hooks).")
@click.option("--conf", default=str(DEFAULT_CONF), show_default=True,
              type=click.Path(exists=True, dir_okay=False))
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
def main(scenario, mode, url, log_dir, drill_dir, conf, json_path, duration, concurrency,
         max_tokens, model, warmup, request_timeout, te, list_, verbose) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if list_ or scenario is None:
        for s in SCENARIOS.values():
            click.echo(f"{s.name:<18}{s.description}")
        raise SystemExit(0 if list_ else 2)
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

    node = None
    try:
        config = load_node_config(conf, overrides=None if url else {"port": free_port()})
        if url is None:
            from deepserve.supervisor.node import Node
            if hasattr(config, "supervisor"):
                config = replace(config, supervisor=replace(config.supervisor, drill=True))
            node = Node(config)
            echo(f"starting a node from {conf} on {node.url}")
            node.start()
            url = node.url
            log_dir = log_dir or getattr(node, "log_dir", None)
            drill_dir = drill_dir or getattr(node, "drill_dir", None)
        if model is None and node is None:
            try:
                model = served_model(url.rstrip("/"))
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
                model = None
        report = run_drill(chosen, url=url.rstrip("/"), model=model or config.served_model,
                           config=config, log_dir=log_dir, drill_dir=drill_dir,
                           duration_s=duration, concurrency=concurrency, max_tokens=max_tokens,
                           warmup_s=warmup, request_timeout_s=request_timeout, te=te,
                           echo=echo)
    except KeyboardInterrupt:
        echo("interrupted")
        raise SystemExit(130) from None
    except Exception as exc:  # noqa: BLE001 - the drill could not run: say why, exit 2
        echo(f"drill error: {type(exc).__name__}: {exc}")
        if verbose:
            raise
        raise SystemExit(2) from None
    finally:
        if node is not None:
            echo("stopping the node")
            node.stop()
    click.echo(report.to_text())
    extra = _describe(report)
    if extra:
        click.echo(extra)
    if json_path:
        report.write_json(json_path)
    sys.stdout.flush()
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
