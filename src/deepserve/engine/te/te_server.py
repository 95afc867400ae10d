"""A TE serving a node: `python -m deepserve.engine.te.te_server --conf RUN_DIR/node.json
--role te --te-id te0 --run-id ID`.

    JE ──SubmitRequest──> [inbox: this TE's tokenizer] ... (a TELauncher's processes)
    this process ──TEUp / TEDown──> cluster manager;  its master ──TEReport──> CM

It starts the TE's processes, serves one warm-up request through them (a
TE joins the TE list only once it has served), announces the TE, and
watches them: when one dies it announces TEDown, stops the rest and exits
non-zero (the node's supervisor restarts it). SIGTERM stops it cleanly; so
does its parent's death. Its engine options are [node] model + its [[te]]
table, or, for a TE the autoscaler added (`--model NAME`), that [[model]]'s;
its addresses are the run's (load_settings). With `--pool` it starts
pre-warmed and becomes the TE an Assign names (prewarmed.py).

Its Ready carries the scale-out stages it timed (messages/scaling.py):
te_pre_load (process or Assign -> its processes up, weights aside), te_load
(the slowest worker's weight load) and te_post_load (the warm-up request),
and where its weights came from (disk or the node's weight cache).
"""

from __future__ import annotations

import time as _time

_STARTED_AT = _time.monotonic()  # before the imports below (torch): a cold TE's start

import dataclasses  # noqa: E402
import logging
import os
import time

import msgspec
import zmq

from deepserve.actor import ActorLife, run_main
from deepserve.config.child import ChildArgs
from deepserve.config.engine import EngineConfig
from deepserve.config.loading import read_run_config
from deepserve.engine.te.launcher import TELauncher
from deepserve.engine.te.prewarmed import wait_for_assignment
from deepserve.ipc.sockets import PullSocket, PushSocket, ipc_address
from deepserve.messages.control import TEUP_INTERVAL_S, TEDown, TEInfo, TEUp
from deepserve.messages.engine import RequestDelta, RequestFailed, SubmitRequest, ToClient
from deepserve.messages.sampling import SamplingParams

log = logging.getLogger(__name__)


class TESettings(msgspec.Struct, frozen=True, kw_only=True):
    """What one TE server takes from the node's resolved config."""

    te_id: str
    te_type: str
    """[[te]] type."""
    inbox: str
    """The run's address for this TE (its tokenizer binds it)."""
    cm: str
    """The cluster manager's inbox."""
    served_model: str
    """[node] served_model, announced in TEUp."""
    engine: EngineConfig
    """[node] model + the [[te]] table's engine options (processes=True)."""
    run_id: str | None = None
    kv_cache: str = ""
    """The node's KV tier service ("": none)."""
    cache_cost_model: bool = True
    """[node] cache_cost_model."""
    started_at: float | None = None
    """time.monotonic() this TE's scale-out began here: a pre-warmed pod's
    Assign (its transit is this TE's too); None: this process's start."""


def load_settings(args: ChildArgs) -> TESettings:
    """The TE's settings; with --pool, once an Assign names the TE this
    pre-warmed process becomes (it waits for it; none: the node is gone)."""
    started_at = None
    if args.pool:
        _, run = read_run_config(args.conf)
        assign = wait_for_assignment(args.te_id, run.te_address(args.te_id), args.parent_pid)
        if assign is None:
            raise SystemExit(0)  # the node is gone
        now = time.monotonic()
        started_at = assign.sent_at if 0 < assign.sent_at <= now else now
        args = dataclasses.replace(args, te_id=assign.te_id, model=assign.model,
                                   run_id=assign.run_id, pool=False)
    config, run = read_run_config(args.conf)
    settings = msgspec.structs.replace(_settings(args, config, run), started_at=started_at)
    engine = cores_share(settings.engine, config)
    if config.cluster.is_cluster:  # peers on other hosts send KV to this host's address
        engine = dataclasses.replace(engine, kv_bind_host=config.cluster.host)
    return msgspec.structs.replace(settings, engine=engine)


def cores_share(engine: EngineConfig, config, cpu_count: int | None = None) -> EngineConfig:
    """A TE without num_threads gets its share of this host's cores: the cores over
    the devices the node's TEs may take ([node] num_devices, else every [[te]]'s
    tp and every [[model]]'s max_tes x tp), times its own tp; at least 1 a device.

    TEs whose torch threads outnumber the cores starve each other: OpenMP's
    threads spin between parallel regions, so two TEs of 2 threads on 2 cores
    each burn the cores the other needs. The default conf/node.toml (2 TEs, 2
    cores) measured with tools/bench_tenants.py: B's TTFT alone 1.25 s with 2
    threads a TE, 0.17 s with 1; A's tokens/s under its flood doubled."""
    if engine.num_threads is not None:
        return engine
    devices = config.node.num_devices or (
        sum(te.num_devices for te in config.tes)
        + sum(m.max_tes * int(m.options.get("tp", 1)) for m in config.models))
    share = max(1, (cpu_count or os.cpu_count() or 1) // max(1, devices))
    return dataclasses.replace(engine, num_threads=share * engine.tp)


def _settings(args: ChildArgs, config, run) -> TESettings:
    is_static = any(te.te_id == args.te_id for te in config.tes)
    if args.model is not None and not is_static:  # a TE the autoscaler added
        try:
            model = config.model_spec(args.model)
        except KeyError:
            raise SystemExit(f"{args.conf}: no model {args.model!r}; "
                             f"it has {list(config.served_models)}") from None
        return TESettings(te_id=args.te_id, te_type="colocated", inbox=run.te_address(args.te_id),
                          cm=run.cm, served_model=model.name, engine=model.engine_config(),
                          run_id=args.run_id, kv_cache=run.kv_cache,
                          cache_cost_model=config.node.cache_cost_model)
    te = next((te for te in config.tes if te.te_id == args.te_id), None)
    if te is None:
        raise SystemExit(f"{args.conf}: no TE {args.te_id!r}; "
                         f"it has {[t.te_id for t in config.tes]}")
    return TESettings(te_id=te.te_id, te_type=te.te_type, inbox=run.tes[te.te_id], cm=run.cm,
                      served_model=config.node.served_model,
                      engine=te.engine_config(config.node.model), run_id=args.run_id,
                      kv_cache=run.kv_cache, cache_cost_model=config.node.cache_cost_model)


def build(ctx: zmq.Context, s: TESettings, life: ActorLife) -> "_Host":
    """The TE started, warmed up and ready to announce (run_main's build)."""
    if life.faults.active("crash") is not None:
        raise SystemExit(f"drill: TE {s.te_id} crashes at start")
    return _Host(s, ctx, life)


class _Host:
    """A started TE: its processes (a TELauncher), warmed up by one request;
    each step announces it to the CM and watches its processes."""

    def __init__(self, s: TESettings, ctx: zmq.Context, life: ActorLife):
        self.te_id = s.te_id
        self.launcher = TELauncher(dataclasses.replace(s.engine, processes=True), s.te_id,
                                   s.inbox, s.cm, s.run_id, tier_address=s.kv_cache,
                                   cache_cost_model=s.cache_cost_model)
        launched = time.monotonic()
        self.launcher.start()
        try:
            loaded = time.monotonic()
            _warm_up(ctx, self.launcher, life)
            self.ready_details = _stages(self.launcher, s.started_at, launched, loaded)
            self.to_cm = PushSocket(ctx, s.cm, bind=False)
            self.sink = PullSocket(ctx, self.launcher.address["client"], bind=True, type=ToClient)
        except BaseException:
            self.launcher.shutdown()
            raise
        self.up = TEUp(info=TEInfo(te_id=s.te_id, te_type=s.te_type, model=s.served_model,
                                   incarnation=self.launcher.run_id,
                                   address=s.inbox, num_devices=s.engine.tp,
                                   block_size=self.launcher.config.block_size,
                                   max_num_seqs=self.launcher.config.max_num_seqs,
                                   max_model_len=self.launcher.config.max_model_len or 0))
        self.last_up = 0.0
        self.num_announced = 0
        self.status = 0

    def progress(self) -> dict[str, int]:
        return {"announced": self.num_announced}

    def step(self) -> bool:
        if time.monotonic() - self.last_up > TEUP_INTERVAL_S:  # a restarted CM hears it again
            try:
                self.to_cm.put(self.up, timeout=1.0)
                self.num_announced += 1
            except TimeoutError:
                pass
            self.last_up = time.monotonic()
        if self.launcher.dead():
            log.error("TE %s lost a process: %s", self.te_id, self.launcher.dead())
            self.status = 1
            return False
        self.sink.drain()  # failures the master sends its own caller: the JE hears via the CM
        time.sleep(0.2)
        return True

    def close(self) -> None:
        dead = self.launcher.dead_names()
        reason = "shutdown" if self.status == 0 else f"process died: {self.launcher.dead()}"
        try:
            self.to_cm.put(TEDown(te_id=self.te_id, reason=reason, address=self.up.info.address,
                                  part=dead[0] if self.status and dead else ""), timeout=1.0)
        except TimeoutError:
            pass  # the cluster manager is gone (node shutting down)
        self.launcher.shutdown()
        time.sleep(0.05)  # let TEDown leave before the context closes
        self.sink.close()
        self.to_cm.close()


def _stages(launcher: TELauncher, started_at: float | None, launched: float,
            loaded: float) -> dict:
    """The stages this TE timed (module doc), in seconds, and its weights' source."""
    if started_at is None:  # a cold process: from its start (imports included)
        started_at = _STARTED_AT
    workers = [d for d in getattr(launcher, "ready_details", {}).values()
               if isinstance(d, dict) and "load_s" in d]
    load_s = max((d["load_s"] for d in workers), default=0.0)
    sources = sorted({d.get("weights", "disk") for d in workers}) or ["disk"]
    return {"stages": {"te_pre_load": round(max(0.0, loaded - started_at - load_s), 4),
                       "te_load": round(load_s, 4),
                       "te_post_load": round(time.monotonic() - loaded, 4)},
            "weights": "+".join(sources)}


def _warm_up(ctx: zmq.Context, launcher: TELauncher, life: ActorLife,
             timeout_s: float = 60.0) -> None:
    """One short greedy request end to end (tokenizer, master, workers)."""
    reply = ipc_address(launcher.run_dir, "warm-up")
    sink = PullSocket(ctx, reply, bind=True, type=ToClient)
    inbox = PushSocket(ctx, launcher.address["tokenizer"], bind=False)
    try:
        inbox.put(SubmitRequest(request_id="warm-up", prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(max_tokens=2, temperature=0.0,
                                                        ignore_eos=True), reply_to=reply))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not life.should_stop():
            try:
                msg = sink.get(timeout=0.2)
            except TimeoutError:
                if launcher.dead():
                    break
                continue
            if isinstance(msg, RequestFailed):
                raise RuntimeError(f"warm-up request failed: {msg.message}")
            if isinstance(msg, RequestDelta) and msg.finish_reason is not None:
                return
        if life.should_stop():  # told to stop (its node gave up starting): no failure
            raise SystemExit(0)
        raise RuntimeError(f"warm-up request not served in {timeout_s:g} s: {launcher.dead()}")
    finally:
        sink.close()
        inbox.close()


def main(argv: list[str] | None = None) -> None:
    status = run_main("te", __doc__.split("\n\n")[0], argv, load_settings, build,
                      lambda host: host.progress(), name=lambda s: (f"te-{s.te_id}", s.te_id),
                      ready=lambda host: host.ready_details, status=lambda host: host.status)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
