"""LoadDriver against a tiny SSE server (the gateway's own renderer makes its
chunks) and against the real gateway on the fake backend."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from deepserve.drill.load import LoadDriver, run_load
from deepserve.drill.report import KEYS, build_report
from deepserve.drill.stream import COMPLETED, FAILED, LOST, first_success_after
from deepserve.gateway.errors import APIError
from deepserve.gateway.http.responses import CompletionRenderer, Usage
from deepserve.messages.engine import RequestDelta

MODEL = "tiny-drill"
SHORT_LEN = 3  # the "short" prompt stops (finish "stop") after this many tokens


def ids_of(prompt: str, max_tokens: int) -> list[int]:
    base = sum(map(ord, prompt))
    n = min(max_tokens, SHORT_LEN) if prompt.startswith("short") else max_tokens
    return [100 + (base * 7 + i * 13) % 900 for i in range(n)]


def make_app(faults: dict[str, str], bodies: list[dict]) -> Starlette:
    """Prompt -> fault: "error" (1 good token, then an error event), "error_bad"
    (1 wrong token, then an error event), "repeat" / "missing" (token 1 twice /
    skipped, then a normal finish), "http503" (a JSON 503), "drop" (connection
    broken after 1 token), "hang" (1 token, then nothing), "hang_headers"
    (no response at all). Anything else: the reference answer."""

    async def completions(request: Request):
        body = await request.json()
        bodies.append(body)
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        fault = faults.get(prompt)
        ids = ids_of(prompt, max_tokens)
        if fault == "http503":
            err = APIError.unavailable("No engine is available.")
            return JSONResponse(err.body(), status_code=503)
        if fault == "hang_headers":
            await asyncio.sleep(3600)
        if fault == "repeat":
            ids = ids[:2] + ids[1:-1]
        elif fault == "missing":
            ids = ids[:1] + ids[2:]
        elif fault == "error_bad":
            ids = [ids[0] + 1]
        elif fault in ("error", "drop", "hang"):
            ids = ids[:1]
        renderer = CompletionRenderer("cmpl-test", MODEL, True, True)

        async def events():
            usage = Usage(1)
            for i, token_id in enumerate(ids):
                finish = None
                if i == len(ids) - 1 and fault in (None, "repeat", "missing"):
                    finish = "stop" if len(ids) < max_tokens else "length"
                delta = RequestDelta(request_id="r", text=f" w{token_id}", token_ids=[token_id],
                                     finish_reason=finish,
                                     logprobs=[(token_id, -0.5, [(token_id, -0.5)])])
                usage.add(0, delta)
                for chunk in renderer.delta_chunks(0, delta):
                    yield sse(chunk)
                await asyncio.sleep(0.01)
            if fault in ("error", "error_bad"):
                yield sse(APIError.unavailable("TE te-0 died", "engine_dead").body())
            elif fault == "drop":
                raise RuntimeError("connection drop (expected in this test)")
            elif fault == "hang":
                await asyncio.sleep(3600)
            else:
                yield sse(renderer.usage_chunk(usage))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request):
        return JSONResponse({"status": "ok", "num_tes": 1})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", health)])


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextmanager
def sse_server(faults: dict[str, str]):
    """Yield (url, bodies received); the server thread is joined on the way out."""
    bodies: list[dict] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(faults, bodies), log_level="critical",
                                           log_config=None, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="drill-sse-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", bodies
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive(), "uvicorn thread did not stop"


FAULTS = {"error": "error", "error_bad": "error_bad", "repeat": "repeat", "missing": "missing",
          "http503": "http503", "drop": "drop", "hang": "hang", "hang_headers": "hang_headers"}
PROMPTS = ["ok-a", "ok-b", "short", *FAULTS]


def test_accounting_of_every_way_a_stream_ends():
    faults: dict[str, str] = {}
    with sse_server(faults) as (url, bodies):
        driver = LoadDriver(url + "/v1", MODEL, prompts=PROMPTS, concurrency=len(PROMPTS),
                            max_tokens=6, request_timeout_s=1.0, deadline_margin_s=0.5)
        reference = driver.reference_sync()
        assert reference == {i: ids_of(p, 6) for i, p in enumerate(PROMPTS)}
        assert len(reference[2]) == SHORT_LEN

        faults.update(FAULTS)
        t0 = time.monotonic()
        records = driver.run_sync(num_requests=len(PROMPTS))
        took = time.monotonic() - t0

    assert bodies[-1] == {"model": MODEL, "prompt": bodies[-1]["prompt"], "max_tokens": 6,
                          "temperature": 0.0, "logprobs": 1, "stream": True,
                          "return_tokens_as_token_ids": True,
                          "stream_options": {"include_usage": True}}
    # the hung ones are given up at request_timeout_s + margin, and run returns
    assert 1.4 < took < 4.0
    by_prompt = {PROMPTS[r.prompt_index]: r for r in records}
    assert [r.id for r in records] == list(range(len(PROMPTS)))
    status = {p: r.status for p, r in by_prompt.items()}
    assert status == {"ok-a": COMPLETED, "ok-b": COMPLETED, "short": COMPLETED,
                      "repeat": COMPLETED, "missing": COMPLETED, "error": FAILED,
                      "error_bad": FAILED, "http503": FAILED, "drop": FAILED, "hang": LOST,
                      "hang_headers": LOST}

    ok = by_prompt["ok-a"]
    assert ok.token_ids == reference[0] and ok.finish_reason == "length"
    assert ok.text == "".join(f" w{t}" for t in reference[0])
    assert ok.usage["completion_tokens"] == 6 and ok.response_id == "cmpl-test"
    assert ok.start <= ok.first_token <= ok.end and ok.error is None
    assert by_prompt["short"].finish_reason == "stop"
    assert by_prompt["error"].error_type == "service_unavailable"
    assert by_prompt["error"].error == "TE te-0 died"
    assert by_prompt["error"].error_code == "engine_dead"
    assert by_prompt["error"].token_ids == reference[PROMPTS.index("error")][:1]
    assert by_prompt["http503"].http_status == 503
    assert by_prompt["http503"].error == "No engine is available."
    assert by_prompt["drop"].error_type == "connection_error"
    for p in ("hang", "hang_headers"):
        assert by_prompt[p].end is None and by_prompt[p].error is None
    assert by_prompt["hang"].token_ids == reference[PROMPTS.index("hang")][:1]

    report = build_report("unit", records, reference, deadline_s=driver.deadline_s,
                          fault_at=None, detected_at=None, recovered_at=None)
    assert (report.sent, report.completed, report.failed, report.lost,
            report.bad_streams) == (11, 5, 4, 2, 3)
    assert sorted(PROMPTS[records[i].prompt_index] for i in report.details["bad"]) == [
        "error_bad", "missing", "repeat"]
    assert not report.ok
    assert tuple(json.loads(report.to_json())) == KEYS
    assert json.loads(report.to_json())["deadline_s"] == 1.5


def test_duration_stop_and_first_success_after():
    with sse_server({}) as (url, bodies):
        records = run_load(url, MODEL, prompts=["a", "b", "c"], duration_s=0.4, concurrency=2,
                           max_tokens=4, request_timeout_s=2.0)
        assert len(records) >= 4
        assert all(r.status == COMPLETED for r in records)
        assert {r.prompt_index for r in records} == {0, 1, 2}
        assert max(r.start for r in records) - records[0].start < 0.6

        # stop() from another thread ends a run without limits; it comes once a
        # request started (a fixed 0.3 s timer beat the first one on a loaded
        # machine: CI with a second suite running, `more` was empty)
        driver = LoadDriver(url, MODEL, prompts=["x"], concurrency=3, max_tokens=2)

        def stop_once_started() -> None:
            deadline = time.monotonic() + 10.0
            while not driver.records and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            driver.stop()

        stopper = threading.Thread(target=stop_once_started)
        stopper.start()
        more = driver.run_sync()
        stopper.join(10.0)
        assert more and all(r.status == COMPLETED for r in more)
        assert max(r.end for r in more) - min(r.start for r in more) < 2.0  # it ended soon

    mid = records[len(records) // 2].start
    after = first_success_after(records, mid)
    expect = min(r.first_token for r in records if r.start > mid)
    assert after == expect and after > mid
    assert first_success_after(records, time.time() + 10) is None


def test_connection_refused_is_failed_not_lost():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there now
    records = run_load(f"http://127.0.0.1:{port}", MODEL, prompts=["a"], num_requests=2,
                       request_timeout_s=2.0)
    assert [r.status for r in records] == [FAILED, FAILED]
    assert records[0].error_type == "connection_error" and records[0].end is not None


def test_against_the_real_gateway():
    """The gateway's own streams: a normal one, a 503 before the stream, an error
    event after its deadline (failed with a correct prefix: not lost, not bad)."""
    from tests.gateway.conftest import running_stack

    with running_stack(request_timeout_s=1.0) as stack:
        driver = LoadDriver(stack.url, "tiny-test", prompts=["hello", "x [dead]", "y [hang]"],
                            concurrency=3, max_tokens=5, request_timeout_s=1.0,
                            deadline_margin_s=2.0, seed=7)
        ref = asyncio.run(driver.reference(["hello"]))[0]
        assert len(ref) == 5 and all(t >= 1000 for t in ref)
        records = driver.run_sync(num_requests=3)
    ok, dead, hung = records
    assert ok.status == COMPLETED and ok.token_ids == ref and ok.usage["completion_tokens"] == 5
    assert dead.status == FAILED and dead.http_status == 503
    assert dead.error_code == "engine_dead"
    assert hung.status == FAILED and hung.error_type == "timeout" and hung.http_status == 200
    assert hung.token_ids == ref[:1]  # the fake backend's words depend on the seed only
    report = build_report("gateway", records, {0: ref, 1: ref, 2: ref}, 1.0, None, None, None)
    assert (report.completed, report.failed, report.lost, report.bad_streams) == (1, 2, 0, 0)
    assert report.ok
