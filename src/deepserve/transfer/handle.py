"""TransferHandle (a future for one transfer) and the daemon threads that run them.

Each DistFlow owns `num_threads` daemon threads fed by one queue. A transfer
is a job on that queue; its handle wraps a `concurrent.futures.Future`. Every
job ends (the backends bound every wait by the DistFlow's timeout), so
`wait()` without a timeout never hangs either. Copies run in torch ops and
zmq sends, which release the GIL, so threads overlap real work.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from deepserve.transfer.types import TransferError, TransferResult

_STOP = None  # queue sentinel


class TransferHandle:
    """One transfer in flight; `wait` returns its TransferResult or raises TransferError."""

    def __init__(self, future: Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> TransferResult:
        """The result; TransferError if the transfer failed or is not done within `timeout` s."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TransferError(f"transfer not done within {timeout} s") from None
        except CancelledError:
            raise TransferError("transfer cancelled: DistFlow closed") from None
        except TransferError:
            raise
        except Exception as e:  # a bug or an OS error inside a backend
            raise TransferError(f"transfer failed: {e!r}") from e

    def add_done_callback(self, fn: Callable[["TransferHandle"], None]) -> None:
        """Call fn(handle) once done (at once if it is done already), on the finishing thread."""
        self._future.add_done_callback(lambda _: fn(self))


class Workers:
    """A fixed set of daemon threads running jobs in submission order."""

    def __init__(self, num_threads: int, name: str = "distflow"):
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(num_threads)]
        self._closed = False
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], TransferResult]) -> TransferHandle:
        if self._closed:
            raise TransferError("DistFlow is closed")
        future: Future = Future()
        self._jobs.put((fn, future))
        return TransferHandle(future)

    def run_inline(self, fn: Callable[[], TransferResult]) -> TransferHandle:
        """Run fn in the caller; a handle that is done already (same error semantics)."""
        if self._closed:
            raise TransferError("DistFlow is closed")
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn())
        except Exception as e:
            future.set_exception(e)
        return TransferHandle(future)

    def close(self, timeout: float) -> None:
        """Cancel jobs not started yet, then stop the threads (bounded join)."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job[1].cancel()
        for _ in self._threads:
            self._jobs.put(_STOP)
        for t in self._threads:
            t.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the waiter, never lost
                future.set_exception(e)
