"""The supervisor's inbox: every watched process -> its node's supervisor.

    actor main loop ──Heartbeat (PUSH, every interval_s)──> supervisor (PULL, bound)
    actor           ──Ready (PUSH, once, after startup)────> supervisor
    actor           ──HealthEvent (PUSH, when it happens)──> supervisor ──> health log

The address comes from the environment variable DEEPSERVE_HEARTBEAT (see
supervisor/heartbeat.py). Heartbeats are sent by the actor's *main loop*,
never by a side thread, and they carry progress counters: the watchdog judges
a process by whether its counters move while it holds work, not merely by
whether heartbeats arrive (a process can answer and still be stuck).
"""

from __future__ import annotations

import msgspec

from deepserve.messages.scaling import ScaleIn, ScaleOut

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)


class Heartbeat(msgspec.Struct, tag="heartbeat", **_STRUCT):
    """component: e.g. "te0/worker0", "te0/master", "job-executor".
    time: the sender's time.monotonic() (node-local clock, seconds).
    progress: monotonic counters the main loop advances (steps, tokens,
    tasks_done, ...); any change of any counter counts as progress.
    holds_work: it has accepted work it has not finished yet; a process that
    holds no work is never judged hung."""

    component: str
    pid: int
    time: float
    progress: dict[str, int]
    holds_work: bool
    details: dict = {}


class Ready(msgspec.Struct, tag="ready", **_STRUCT):
    """The component finished starting up (weights loaded, sockets bound);
    its startup grace ends here and the heartbeat deadline applies."""

    component: str
    pid: int
    time: float
    details: dict = {}


class HealthEvent(msgspec.Struct, tag="event", **_STRUCT):
    """Something a component wants in the node's health log (e.g. the job
    executor's request_migrated); event is one of health_log.EVENTS."""

    component: str
    pid: int
    event: str
    details: dict = {}


ToSupervisor = Heartbeat | Ready | HealthEvent | ScaleOut | ScaleIn
