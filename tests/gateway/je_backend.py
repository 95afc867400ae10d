"""A real job executor behind the gateway, with a fake CM and one fake TE
that holds every task it gets (answers nothing; an abort ends it: TaskDone
to the JE, as a TE's tokenizer sends): one thread owns them all.

    gateway PUSH ──SubmitRequest──> JobExecutor (real: tenants, limits) ──> TE PULL (held)
    gateway SUB  <──TEList (every 0.1 s)── PUB (cm_address)

For tests of what the JE decides and the gateway answers (429 + Retry-After).
"""

from __future__ import annotations

import threading
from pathlib import Path

import zmq

from deepserve.config.node import RouterSection
from deepserve.config.tenants import TenantsSection
from deepserve.control.je.je_settings import JESettings
from deepserve.control.je.job_executor import JobExecutor
from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket
from deepserve.messages.control import TEInfo, TEList
from deepserve.messages.engine import AbortRequest, SubmitRequest, TaskDone


class JEBackend:
    model_dir: Path  # set by the test: the tokenizer the JE loads
    model_name = "tiny-test"
    tenants = TenantsSection()

    def __init__(self, je_address: str, cm_address: str):
        self.je_address, self.cm_address = je_address, cm_address
        self.te_address = "ipc://" + str(Path(je_address.removeprefix("ipc://")).with_name("te0.sock"))
        self.submits: list[SubmitRequest] = []
        self._stop, self._ready = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="je-backend", daemon=True)

    def start(self) -> "JEBackend":
        self._thread.start()
        if not self._ready.wait(30.0) or self._error is not None:
            raise RuntimeError("the JE backend did not start") from self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        assert not self._thread.is_alive(), "JE backend thread did not stop"

    def _run(self) -> None:
        ctx = zmq.Context()
        socks = []
        try:
            je = JobExecutor(ctx, JESettings(
                inbox=self.je_address, cm_pub=self.cm_address, max_attempts=3,
                models={self.model_name: str(self.model_dir)}, router=RouterSection(),
                tenants=self.tenants))
            socks = [je, PubSocket(ctx, self.cm_address),
                     PullSocket(ctx, self.te_address, bind=True, type=SubmitRequest | AbortRequest),
                     PushSocket(ctx, self.je_address, bind=False)]
            _, cm, te, to_je = socks
            te_list = TEList(tes=[TEInfo(te_id="te0", model=self.model_name,
                                         address=self.te_address, max_num_seqs=64)])
            self._ready.set()
            while not self._stop.is_set():
                cm.put(te_list)
                for _ in range(5):
                    je.step(20)
                for msg in te.drain():
                    if isinstance(msg, SubmitRequest):
                        self.submits.append(msg)
                    else:
                        to_je.put(TaskDone(request_id=msg.request_id))
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()
        finally:
            for sock in reversed(socks):
                sock.close()
            ctx.term()
