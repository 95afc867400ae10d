"""The life every DeepServe process follows.

    set log prefix -> install signal handlers (they only set a flag) -> build
    state -> ready() -> run(step): beat, step, until the flag is set or the
    parent is gone -> in `finally`, release in reverse order, life.close() last.

    ActorLife ── heartbeat (PUSH, non-blocking) ──> the node's supervisor
              ── fault_injected events (drills only) ──┘
              <── death pipe EOF / reparenting: the parent is gone

Parent death, one rule for every child: a child started by multiprocessing
gets the read end of a *death pipe* (the parent never writes; EOF means it
died); a child started as a command gets its parent's pid (it stops once it
is reparented). Parents notice dead children through sentinels / Popen.

Heartbeats go to $DEEPSERVE_HEARTBEAT when it is set, else nowhere (a
NullHeartbeat): no actor tests for a supervisor. Progress counters are read
by `run` from the main loop itself, never from a side thread (a side thread
keeps beating while the main thread is stuck in a collective). Fault hooks
(faults.py) are read through `life.faults`; each firing is reported as a
`fault_injected` health event, so a drill can prove its fault happened.

run_main is the whole main() of every actor started as a command (the job
executor, the cluster manager, the KV tier service, a TE's server): parse the child
command line, load its settings, build the actor in a ZeroMQ context, run it,
release everything on every way out.
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection
from typing import Callable, Protocol, TypeVar

import zmq

from deepserve.config.child import ChildArgs, parse_child_args, print_config
from deepserve.faults import FaultHooks, NoFaults
from deepserve.ipc import curve
from deepserve.ipc.heartbeat import ENV_VAR as HEARTBEAT_ENV
from deepserve.ipc.heartbeat import HeartbeatSender, NullHeartbeat

log = logging.getLogger(__name__)


class ActorLife:
    """name: the log prefix; component: the name the supervisor knows this
    process by (e.g. "te0/worker1"; default: name). death_pipe: for children
    started by multiprocessing; parent_pid: for children started as commands.
    signals=False leaves SIGTERM/SIGINT to someone else (uvicorn)."""

    def __init__(self, name: str, death_pipe: Connection | None = None,
                 parent_pid: int | None = None, *, component: str | None = None,
                 signals: bool = True, heartbeat_interval_s: float = 0.5):
        self.name = name
        self.component = component or name
        self._death_pipe = death_pipe
        self._parent_pid = parent_pid
        self._stop_requested = False
        logging.basicConfig(level=os.environ.get("DEEPSERVE_LOG_LEVEL", "WARNING"),
                            format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s")
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        curve.set_component(self.component)  # whom a refused peer is reported by
        self._ctx: zmq.Context | None = None
        self.heartbeat: HeartbeatSender | NullHeartbeat = NullHeartbeat()
        address = os.environ.get(HEARTBEAT_ENV)
        if address:
            self._ctx = zmq.Context()
            self.heartbeat = HeartbeatSender(self._ctx, address, self.component,
                                             heartbeat_interval_s)
        self.faults: FaultHooks | NoFaults = FaultHooks.from_env(self.component,
                                                                 on_fired=self._on_fault)

    # -- stopping ----------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self._stop_requested = True  # only a flag: the loop decides when to stop

    def request_stop(self) -> None:
        self._stop_requested = True

    @property
    def is_parent_alive(self) -> bool:
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            return False
        if self._death_pipe is None:
            return True
        try:
            return not self._death_pipe.poll(0)  # readable only at EOF
        except (OSError, EOFError):
            return False

    def should_stop(self) -> bool:
        return self._stop_requested or not self.is_parent_alive

    # -- talking to the supervisor -------------------------------------------------
    def ready(self, **details) -> None:
        """Startup is over: the supervisor's startup grace ends here."""
        self.heartbeat.ready(details)

    def beat(self, progress: dict[str, int], holds_work: bool = False) -> None:
        self.heartbeat.beat(progress, holds_work)

    def event(self, event: str, **details) -> None:
        """A health-log event (one of supervisor/health_log.EVENTS)."""
        self.heartbeat.event(event, **details)

    def _on_fault(self, fault: str, value: str) -> None:
        log.warning("drill: fault %s fired (%r)", fault, value)
        self.heartbeat.event("fault_injected", fault=fault, value=value)

    # -- the loop ------------------------------------------------------------------
    def run(self, step: Callable[[], object], progress: Callable[[], dict[str, int]],
            holds_work: Callable[[], bool] | None = None) -> None:
        """The main loop: beat (when due), then one step, until stopped. `step`
        bounds its own wait (a poll timeout), so a stop or a dead parent is
        noticed within one step. A step returning False ends the loop."""
        while not self.should_stop():
            self.heartbeat.beat(progress(), holds_work() if holds_work is not None else False)
            if step() is False:
                return

    def close(self) -> None:
        """Last in every actor's `finally` (its socket lives in our own context)."""
        self.heartbeat.close()
        self.heartbeat = NullHeartbeat()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class Actor(Protocol):
    """What run_main drives: one bounded step of the loop, and a close."""

    def step(self) -> object: ...

    def close(self) -> None: ...


S = TypeVar("S")
A = TypeVar("A", bound=Actor)


def run_main(role: str, description: str, argv: list[str] | None,
             load_settings: Callable[[ChildArgs], S],
             build: Callable[[zmq.Context, S, ActorLife], A],
             progress: Callable[[A], dict[str, int]], *,
             name: Callable[[S], tuple[str, str | None]] | None = None,
             ready: Callable[[A], dict] | None = None,
             status: Callable[[A], int] | None = None) -> int:
    """main() of the actor that plays `role` (config/child.py): --print-config
    prints the settings and returns; otherwise life (log prefix `role`,
    signals, heartbeats) -> context -> build -> ready -> run -> close the
    actor, term the context, close life. A build that fails closes what it
    made with the context (no socket left to block term) and raises.

    name: the life's log prefix and health-log component from the settings
    (default: `role`, no component); ready: details for the ready event
    (a TE's scale-out stages); status: the process's exit status once the
    loop ended (default 0), returned."""
    args = parse_child_args(argv, role, description)
    settings = load_settings(args)
    if args.print_config:
        print_config(settings)
        return 0
    prefix, component = name(settings) if name is not None else (role, None)
    life = ActorLife(prefix, parent_pid=args.parent_pid, component=component)
    ctx = zmq.Context()
    try:
        actor = build(ctx, settings, life)
    except BaseException:
        ctx.destroy(linger=0)
        life.close()
        raise
    try:
        life.ready(**(ready(actor) if ready is not None else {}))
        life.run(actor.step, lambda: progress(actor))
    finally:
        actor.close()
        ctx.term()
        life.close()
    return status(actor) if status is not None else 0
