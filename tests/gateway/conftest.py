"""Gateway test stacks: a FakeBackend thread + the real gateway under uvicorn
in a background thread, on a free port, with bounded startup and shutdown."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from hypothesis.configuration import set_hypothesis_home_dir
from openai import OpenAI

from deepserve.gateway import GatewayConfig, create_app
from deepserve.gateway.http.server import server_config
from deepserve.ipc.sockets import ipc_address
from tests.gateway.fake_backend import FakeBackend

MODEL = "tiny-test"
STARTUP_TIMEOUT_S = 10.0

# Hypothesis keeps a cache under ./.hypothesis; keep the working tree clean.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="dsgw-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)


@dataclass
class Stack:
    backend: FakeBackend
    config: GatewayConfig
    url: str
    server: uvicorn.Server

    def openai(self, api_key: str = "unused", **kwargs) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                      timeout=kwargs.pop("timeout", 10.0), **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 10.0), **kwargs)


@contextmanager
def running_stack(send_buffer: int | None = None, backend_type=FakeBackend,
                  healthy: bool = True, standby: bool = False, **overrides):
    """Yield a Stack; stop and join everything on the way out. send_buffer:
    SO_SNDBUF of the listening socket (accepted sockets inherit it);
    backend_type(je_address, cm_address): what plays the JE, TEs and CM;
    healthy=False: yield once uvicorn serves, before any TE list; standby: the
    gateway's JE address lists a second head's (Stack.standby_je, where
    FakeBackend.move_je moves the JE) after the backend's."""
    run_dir = tempfile.mkdtemp(prefix="dsgw-", dir="/tmp")
    backend = backend_type(ipc_address(run_dir, "je"), ipc_address(run_dir, "cm")).start()
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (else ~40 ms a reply)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    thread = None
    try:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        je_address = backend.je_address
        if standby:
            je_address += "," + ipc_address(run_dir, "je-standby")
        config = GatewayConfig(je_address=je_address, cm_address=backend.cm_address,
                               reply_address=ipc_address(run_dir, "reply"), port=port,
                               served_model=MODEL, **overrides)
        server = uvicorn.Server(server_config(config, create_app(config), log_level="warning",
                                             log_config=None, timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="gateway-uvicorn", daemon=True)
        thread.start()
        stack = Stack(backend, config, f"http://127.0.0.1:{port}", server)
        _wait_healthy(stack, thread, healthy)
        yield stack
    finally:
        if thread is not None:
            server.should_exit = True
            thread.join(10.0)
            assert not thread.is_alive(), "uvicorn thread did not stop"
        sock.close()
        backend.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _wait_healthy(stack: Stack, thread: threading.Thread, healthy: bool = True) -> None:
    """Wait until uvicorn serves and (healthy) the gateway has seen the fake CM's TE list."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with stack.http(timeout=1.0) as http:
        while time.monotonic() < deadline:
            if not thread.is_alive():
                raise RuntimeError("the gateway server thread exited during startup")
            if stack.server.started and not healthy:
                return
            if stack.server.started:
                try:
                    if http.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.02)
    raise TimeoutError(f"gateway not healthy within {STARTUP_TIMEOUT_S} s")


@pytest.fixture(scope="session", autouse=True)
def no_leftover_threads():
    """Torn down last: every stack's threads must have been joined."""
    yield
    left = [t.name for t in threading.enumerate()
            if t.name in ("fake-backend", "gateway-uvicorn", "je-backend") and t.is_alive()]
    shutil.rmtree(_HYPOTHESIS_HOME, ignore_errors=True)
    assert not left, f"threads left running: {left}"


@pytest.fixture(scope="session")
def stack():
    """The shared stack: no API keys, a 3 s deadline, room for 64 open requests."""
    with running_stack(request_timeout_s=3.0, max_open_requests=64,
                       max_prompt_chars=100_000) as s:
        yield s


@pytest.fixture
def make_stack():
    """A factory for stacks with their own config (closed at test end)."""
    with ExitStack() as stacks:
        yield lambda **overrides: stacks.enter_context(running_stack(**overrides))
