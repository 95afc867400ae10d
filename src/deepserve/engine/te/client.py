"""EngineClient: the caller's side of a process-mode TE.

    caller ──SubmitRequest/AbortRequest (PUSH)──> tokenizer
    caller <──RequestDelta/RequestFailed (PULL, bound here)── tokenizer, master

It owns the TELauncher, so it is also the one that notices a dead TE process:
then every request still open here ends with RequestFailed("engine_dead") and
the rest of the TE is stopped.
"""

from __future__ import annotations

import time

import zmq

from deepserve.config import EngineConfig
from deepserve.engine.te.launcher import TELauncher
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.messages.engine import (AbortRequest, EngineStats, GetStats, RequestDelta,
                                       RequestFailed, SubmitRequest, ToClient)


class EngineClient:
    def __init__(self, config: EngineConfig, **launcher_options):
        """launcher_options: TELauncher's (tier_address, cache_cost_model)."""
        self.launcher = TELauncher(config, **launcher_options)
        self.config = self.launcher.config
        self.ctx = zmq.Context()
        self.inbox = PullSocket(self.ctx, self.launcher.address["client"], bind=True,
                                type=ToClient)
        self.outbox = PushSocket(self.ctx, self.launcher.address["tokenizer"], bind=False)
        self.open_requests: set[str] = set()
        self.failure: str | None = None
        try:
            self.launcher.start()
        except BaseException:
            self._close_sockets()
            raise

    def submit(self, msg: SubmitRequest) -> None:
        """Send a request; on a dead TE it fails at the next poll()."""
        self.open_requests.add(msg.request_id)
        if self.failure is None:
            self.outbox.put(msg)

    def abort(self, request_id: str) -> None:
        if request_id in self.open_requests and self.failure is None:
            self.outbox.put(AbortRequest(request_id=request_id))

    def poll(self, timeout: float) -> list[RequestDelta | RequestFailed]:
        """Messages that arrived within timeout seconds; when a TE process has
        died, a RequestFailed for every open request."""
        out = self.inbox.drain() if self.inbox.poll(timeout) else []
        out.extend(self._local_failures())
        for msg in out:
            if isinstance(msg, RequestFailed) or getattr(msg, "finish_reason", None):
                self.open_requests.discard(msg.request_id)
        return out

    def stats(self, timeout: float = 10.0) -> EngineStats:
        """The master's EngineStats (deltas that arrive meanwhile are dropped:
        call it when no request is open)."""
        self.outbox.put(GetStats())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self.poll(timeout=0.1):
                if isinstance(msg, EngineStats):
                    return msg
        raise TimeoutError("no EngineStats from the master")

    def _local_failures(self) -> list[RequestFailed]:
        if self.failure is None:
            dead = self.launcher.dead()
            if not dead:
                return []
            self.failure = f"TE process died: {', '.join(dead)}"
            self.launcher.shutdown()
        return [RequestFailed(request_id=r, error="engine_dead", message=self.failure)
                for r in self.open_requests]

    def shutdown(self) -> None:
        if self.failure is None:
            self.failure = "the TE was shut down"
        self.launcher.shutdown()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.inbox.close()
        self.outbox.close()
        self.ctx.term()
