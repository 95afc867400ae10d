"""The chaos load: the workload's requests, `concurrency` at a time, every
one recorded with its spec until stop().

    ChaosLoad.run_sync() (its own thread) ── worker × concurrency:
        i = next id ──Workload.spec(i)──> (path, body, headers)
        ──drill LoadDriver.send (bounded: request_timeout_s + margin, else lost)──> RequestRecord
    records(): the RequestRecords so far (live; the drills' recovery looks at them)
    pairs():   (spec, record) of every request once the load ended

Sending and reading (SSE or JSON, errors, deadlines) is the drill's
LoadDriver.send; this module only chooses what to send.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import httpx

from deepserve.chaos.workload import RequestSpec, Workload
from deepserve.drill.load import RECONNECT_S, LoadDriver
from deepserve.drill.stream import CONNECTION_ERROR, RequestRecord, now


class ChaosLoad:
    def __init__(self, url: str, workload: Workload, *, concurrency: int = 3,
                 request_timeout_s: float = 60.0):
        self.url, self.workload, self.concurrency = url, workload, concurrency
        self.sender = LoadDriver(url, workload.model, prompts=["-"], concurrency=concurrency,
                                 max_tokens=workload.max_tokens,
                                 request_timeout_s=request_timeout_s)
        self._pairs: list[tuple[RequestSpec, RequestRecord]] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def deadline_s(self) -> float:
        return self.sender.deadline_s

    def records(self) -> list[RequestRecord]:
        with self._lock:
            return [r for _, r in self._pairs]

    def pairs(self) -> list[tuple[RequestSpec, RequestRecord]]:
        with self._lock:
            return list(self._pairs)

    def stop(self) -> None:
        """No request starts after this; open ones run to their end or deadline."""
        self._stopped.set()

    def client(self) -> httpx.AsyncClient:
        timeout = httpx.Timeout(self.deadline_s + 1.0)
        limits = httpx.Limits(max_connections=self.concurrency + 2,
                              max_keepalive_connections=self.concurrency + 2)
        return httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits)

    async def send(self, client: httpx.AsyncClient, spec: RequestSpec,
                   records: list | None = None) -> RequestRecord:
        """One request of `spec`; its record goes into `records` (under the
        lock) before it is sent, so an open request is seen as one."""
        path, body, headers = self.workload.request(spec)
        record = RequestRecord(id=spec.id, prompt_index=spec.prompt,
                               max_tokens=self.workload.max_tokens, start=now())
        if records is not None:
            with self._lock:
                records.append((spec, record))
        await self.sender.send(client, record, path, body, headers)
        return record

    async def run(self) -> None:
        counter = itertools.count()
        async with self.client() as client:
            async def worker() -> None:
                while not self._stopped.is_set():
                    record = await self.send(client, self.workload.spec(next(counter)),
                                             self._pairs)
                    if record.error_type == CONNECTION_ERROR:  # as a client would: not
                        await asyncio.sleep(RECONNECT_S)  # hundreds of refusals a second

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    def run_sync(self) -> None:
        asyncio.run(self.run())
