"""Bounded resources on the gateway's data path, over real sockets against
the real uvicorn server as gateway/http/server.py configures it (the connection
guard): silent and trickling connections are closed, a connection flood gets
503 with an OpenAI body, a client that stops reading is cut off and its
sub-requests aborted, and until then its stream counts toward max_open_requests.

The listening socket's send buffer is small (accepted sockets inherit it), so
a client that does not read fills the kernel's buffers within a few KiB."""

from __future__ import annotations

import select
import socket
import time
from contextlib import ExitStack, closing

import pytest

from tests.gateway.conftest import MODEL, Stack, running_stack

SMALL_BUFFER = 4096
LIVENESS_S = 10.0
"""How long a test waits for something that must happen (not a speed bound)."""


def guarded_stack(**overrides):
    return running_stack(send_buffer=SMALL_BUFFER, **overrides)


@pytest.fixture
def make_guarded():
    with ExitStack() as stacks:
        yield lambda **overrides: stacks.enter_context(guarded_stack(**overrides))


def _connect(stack: Stack, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", stack.config.port))
    return sock


def _is_closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """True once the server closed or reset the connection (any unread bytes drained)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            try:
                if not sock.recv(65536):
                    return True
            except (ConnectionResetError, BrokenPipeError):
                return True
    return False


def _client(stack: Stack):
    return stack.server.config.app.state.gateway.client


def _stream_request(max_tokens: int) -> bytes:
    body = (b'{"model":"%s","prompt":"flood","max_tokens":%d,"stream":true,"logprobs":5}'
            % (MODEL.encode(), max_tokens))
    return (b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def test_a_connection_that_never_sends_a_request_is_closed(make_guarded):
    """uvicorn's timeout_keep_alive starts only after a first response: without
    the guard this connection stays open for good."""
    stack = make_guarded(read_timeout_s=0.5)
    with closing(_connect(stack)) as sock:
        assert _is_closed_by_peer(sock, LIVENESS_S)


def test_a_trickled_request_head_is_cut_off(make_guarded):
    """A byte now and then resets no deadline: the head must be whole in time."""
    stack = make_guarded(read_timeout_s=0.5)
    with closing(_connect(stack)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: gw\r\n")
        deadline = time.monotonic() + LIVENESS_S
        is_closed = False
        while not is_closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"x-slow: 1\r\n")
            except (BrokenPipeError, ConnectionResetError):
                is_closed = True
            is_closed = is_closed or _is_closed_by_peer(sock, 0.1)
        assert is_closed


def test_a_response_may_outlast_the_read_timeout(make_guarded):
    """The read deadline covers the request only, never a stream being answered."""
    stack = make_guarded(read_timeout_s=1.0)
    stack.backend.delay_s = 0.25
    with stack.http(timeout=LIVENESS_S) as http:
        for _ in range(2):  # and the kept-alive connection serves the next request
            resp = http.post("/v1/completions", json={
                "model": MODEL, "prompt": "long answer", "max_tokens": 6, "stream": True})
            assert resp.status_code == 200
            assert resp.text.rstrip().endswith("data: [DONE]")
            assert '"error"' not in resp.text


def test_a_connection_flood_gets_503_with_an_openai_body(make_guarded):
    stack = make_guarded(max_connections=3, read_timeout_s=30.0)
    idle = [_connect(stack) for _ in range(3)]
    try:
        with stack.http(timeout=LIVENESS_S) as http:
            assert stack.backend.wait_for(lambda: len(stack.server.server_state.connections) >= 3)
            resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "one more"})
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "too_many_connections"
            assert resp.headers["connection"] == "close"
    finally:
        for sock in idle:
            sock.close()
    with stack.http(timeout=LIVENESS_S) as http:  # never a dead gateway
        assert stack.backend.wait_for(lambda: http.get("/health").status_code == 200)


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(make_guarded):
    """Without a write deadline the TE generates all 100000 tokens into a
    client that reads none of them."""
    stack = make_guarded(write_timeout_s=0.5)
    client = _client(stack)
    with closing(_connect(stack, rcvbuf=SMALL_BUFFER)) as sock:
        sock.sendall(_stream_request(100_000))
        assert stack.backend.wait_for(lambda: stack.backend.aborts, LIVENESS_S)
        [submit] = stack.backend.submits
        assert stack.backend.aborts == [submit.request_id]
        assert _is_closed_by_peer(sock, LIVENESS_S)  # reset: reading now finds the end
    assert stack.backend.wait_for(lambda: client.num_open_requests == 0, LIVENESS_S)


def test_a_stuck_stream_is_aborted_when_its_queue_fills_and_counts_until_cut_off(make_guarded):
    """max_queued_replies: the sub-request is aborted as soon as the writer falls
    that far behind; the connection still holds its place (429 for the next
    request) until the write deadline cuts it off."""
    stack = make_guarded(max_queued_replies=8, write_timeout_s=5.0, max_open_requests=1)
    client = _client(stack)
    with closing(_connect(stack, rcvbuf=SMALL_BUFFER)) as sock:
        sock.sendall(_stream_request(100_000))
        assert stack.backend.wait_for(lambda: stack.backend.aborts, LIVENESS_S)
        assert client.num_open_requests == 1  # aborted at the TE, not yet cut off
        with stack.http(timeout=LIVENESS_S) as http:
            body = {"model": MODEL, "prompt": "next", "max_tokens": 2}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 429, resp.text
            assert _is_closed_by_peer(sock, LIVENESS_S)
            assert stack.backend.wait_for(lambda: client.num_open_requests == 0, LIVENESS_S)
            assert http.post("/v1/completions", json=body).status_code == 200
