"""A real tier service (tiers/tier_server.py) on a thread, with real sockets."""

from __future__ import annotations

import queue
import threading

import pytest
import zmq

from deepserve.ipc.segments import list_segments, segment_name
from deepserve.ipc.sockets import ipc_address
from deepserve.tiers.tier_server import TierServer
from deepserve.tiers.tier_settings import TierSettings


class TierService:
    """The service's loop on a thread that owns its sockets; stop() unlinks its pools."""

    def __init__(self, settings: TierSettings):
        self.settings = settings
        self.server: TierServer | None = None
        self._stop = threading.Event()
        self._up = threading.Event()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._up.wait(10), "tier service did not start"

    @property
    def address(self) -> str:
        return self.settings.inbox

    def _run(self) -> None:
        ctx = zmq.Context()
        self.server = TierServer(self.settings, ctx)
        self._up.set()
        try:
            while not self._stop.is_set():
                self.server.step()
                while not self._calls.empty():
                    fn, done = self._calls.get()
                    done.put(fn(self.server))
        finally:
            self.server.close()
            ctx.term()

    def call(self, fn, timeout: float = 5.0):
        """Run fn(server) on the service's thread between two steps (for asserts)."""
        done: queue.Queue = queue.Queue()
        self._calls.put((fn, done))
        return done.get(timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def tier_service(short_dir, tmp_path):
    """make(host_bytes, disk_bytes=0, **settings) -> a running TierService."""
    started = []

    def make(host_bytes: int, disk_bytes: int = 0, **kw) -> TierService:
        run_id = f"t{len(started)}{short_dir.name[-6:]}"
        settings = TierSettings(inbox=ipc_address(short_dir, f"kvc{len(started)}"),
                                run_id=run_id, host_bytes=host_bytes,
                                disk_dir=str(tmp_path / "disk") if disk_bytes else "",
                                disk_bytes=disk_bytes, **kw)
        service = TierService(settings)
        started.append(service)
        return service

    yield make
    for service in started:
        service.stop()
        assert not list_segments(segment_name(service.settings.run_id, "")), "pool leaked"
