"""tools/traces.py generators and tools/bench_serve.py's summary and replay loop
(against a tiny fake OpenAI-compatible server on 127.0.0.1). Its SSE parser is
the drill's: tests/drill/test_sse.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


traces = _load("traces")
bench = _load("bench_serve")


def generate(*argv: str) -> list[dict]:
    return list(traces.generate(traces.parse_args([*argv[:1], "--out", "-", *argv[1:]])))


# -- traces ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chat", "code", "agentic"])
def test_same_seed_same_file_other_seed_other_file(tmp_path, kind):
    paths = [tmp_path / f"{kind}{i}.jsonl" for i in range(3)]
    for path, seed in zip(paths, ("0", "0", "1")):
        traces.main([kind, "--out", str(path), "--seed", seed, "--scale", "0.5"])
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    assert all(json.loads(line)["kind"] == kind for line in paths[0].read_text().splitlines())


def test_chat_sizes():
    records = generate("chat", "--num-requests", "40", "--prompt-tokens", "20-80",
                       "--max-tokens", "64-256")
    assert len(records) == 40 and len({r["id"] for r in records}) == 40
    for r in records:
        [message] = r["messages"]
        assert message["role"] == "user"
        assert 19 <= r["prompt_tokens_est"] == traces.approx_tokens(message["content"]) <= 81
        assert 64 <= r["max_tokens"] <= 256


def test_code_sizes_and_content():
    records = generate("code", "--num-requests", "6", "--prompt-tokens", "1000-3000",
                       "--max-tokens", "16-64")
    for r in records:
        assert 999 <= r["prompt_tokens_est"] == traces.approx_tokens(r["prompt"]) <= 3001
        assert 16 <= r["max_tokens"] <= 64
        assert "def " in r["prompt"] or "class " in r["prompt"]
        assert "# Task: " in r["prompt"]


def test_scale_multiplies_every_token_size():
    records = generate("code", "--num-requests", "6", "--prompt-tokens", "1000-3000",
                       "--max-tokens", "20-40", "--scale", "0.1")
    assert all(99 <= r["prompt_tokens_est"] <= 301 and 2 <= r["max_tokens"] <= 4 for r in records)


def test_agentic_sessions_turns_and_sizes():
    records = generate("agentic", "--num-sessions", "6", "--turns", "5-20",
                       "--context-tokens", "400-1000", "--append-tokens", "30-300",
                       "--max-tokens", "16-128")
    assert len(records) == 6
    system = traces.approx_tokens(traces.SYSTEM_AGENT)
    for r in records:
        first, *rest = r["turns"]
        assert 5 <= len(r["turns"]) <= 20
        assert [m["role"] for m in first["messages"]] == ["system", "user"]
        assert first["messages"][0]["content"] == traces.SYSTEM_AGENT  # shared by every session
        assert 399 <= first["append_tokens_est"] - system <= 1001
        for turn in rest:
            [message] = turn["messages"]
            assert message["role"] == "user" and message["content"].startswith("$ ")
            assert turn["append_tokens_est"] == traces.approx_tokens(message["content"])
            assert 28 <= turn["append_tokens_est"] <= 302
        assert all(16 <= t["max_tokens"] <= 128 for t in r["turns"])


def test_agentic_contexts_grow_and_are_mostly_a_shared_prefix():
    """Replay with replies of max_tokens tokens: prompt i+1 extends prompt i + reply i."""
    records = generate("agentic", "--num-sessions", "4", "--turns", "8")
    new = total = 0
    for r in records:
        context, previous = [], None
        for i, turn in enumerate(r["turns"]):
            context += turn["messages"]
            prompt = [dict(m) for m in context]
            if previous is not None:
                assert prompt[:len(previous)] == previous and len(prompt) > len(previous)
                total += sum(traces.approx_tokens(m["content"]) for m in prompt)
                new += turn["append_tokens_est"]
            context.append({"role": "assistant", "content": "x" * 4 * turn["max_tokens"]})
            previous = [dict(m) for m in context]
    assert new / total < 0.2  # > 80% of the tokens of turns 1.. were in the previous prompt


def test_parse_range():
    assert traces.parse_range("7") == (7, 7) and traces.parse_range("5-20") == (5, 20)
    for bad in ("0", "9-3", "-4"):
        with pytest.raises(Exception):
            traces.parse_range(bad)


# -- bench_serve: summary -------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    xs = list(range(100, 0, -1))  # 1..100, unsorted
    assert bench.stats.percentile(xs, 50) == 50.5
    assert bench.stats.percentile(xs, 90) == pytest.approx(90.1)
    assert bench.stats.percentile(xs, 99) == pytest.approx(99.01)
    assert bench.stats.percentile([3.0], 99) == 3.0
    assert bench.stats.percentile([], 50) is None
    assert bench.stats.percentile([1, 2], 0) == 1 and bench.stats.percentile([1, 2], 100) == 2


def _result(ttft, e2e, completion, prompt, cached, itl=(), ok=True, error=None):
    r = bench.RequestResult("s", 0, ok=ok, error=error, ttft_s=ttft, e2e_s=e2e,
                            itl_s=list(itl), prompt_tokens=prompt, cached_tokens=cached,
                            completion_tokens=completion, has_usage=True)
    return r


def test_summarize_exact():
    results = [_result(0.1, 1.1, 11, 100, 50, itl=[0.1] * 10),
               _result(0.3, 0.7, 5, 300, 250, itl=[0.1, 0.1, 0.1, 0.1]),
               _result(None, 0.2, 0, 0, 0, ok=False, error="HTTP 429: busy"),
               _result(None, 0.2, 0, 0, 0, ok=False, error="HTTP 429: busy")]
    assert results[0].tpot_s == pytest.approx(0.1) and results[1].tpot_s == pytest.approx(0.1)
    s = bench.summarize(results, duration_s=2.0, num_sessions_started=4, num_sessions_done=2)
    assert (s["num_ok"], s["num_failed"]) == (2, 2)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 8.0
    assert (s["prompt_tokens"], s["cached_tokens"], s["completion_tokens"]) == (400, 300, 16)
    assert s["cache_hit_rate"] == 0.75
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["p90"] == pytest.approx(280)
    assert s["e2e_ms"]["p50"] == pytest.approx(900) and s["e2e_ms"]["mean"] == pytest.approx(900)
    assert s["itl_ms"]["p99"] == pytest.approx(100)
    assert s["errors"] == {"HTTP 429: busy": 2}
    table = bench.format_table(s)
    assert "2 / 2" in table and "75.0%" in table and "error x2: HTTP 429: busy" in table
    empty = bench.summarize([], 1.0)
    assert empty["cache_hit_rate"] is None and empty["ttft_ms"]["p50"] is None
    bench.format_table(empty)


# -- bench_serve against a fake server --------------------------------------------------
class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams 'tok0 tok1 ...' (max_tokens chunks) with usage; prompt 'fail' -> 500,
    'slow' -> sleeps past the client's timeout."""

    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send_json(200, {"object": "list", "data": [{"id": "fake-model"}]})

    def do_POST(self):
        try:
            self._post()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout, cancelled straggler)

    def _post(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        auth = self.headers.get("Authorization")
        FakeOpenAI.seen.append(body | {"path": self.path, "auth": auth})
        text = body.get("prompt") or body["messages"][-1]["content"]
        if text == "fail":
            return self._send_json(500, {"error": {"message": "boom"}})
        if text == "slow":
            time.sleep(1.0)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chat = self.path.endswith("/chat/completions")
        n = body["max_tokens"]
        for i in range(n):
            choice = {"delta": {"content": f"tok{i} "}} if chat else {"text": f"tok{i} "}
            self._chunk({"choices": [choice | {"index": 0}]})
        prompt = len(json.dumps(body.get("messages") or body.get("prompt")))
        usage = {"prompt_tokens": prompt, "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}
        self._chunk({"choices": [], "usage": usage})
        self._chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, obj):
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    FakeOpenAI.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _run(url: str, trace: Path, *argv: str) -> dict:
    args = bench.parse_args(["--url", url, "--trace", str(trace), "--request-timeout", "0.5",
                             "--grace", "2", *argv])
    return asyncio.run(asyncio.wait_for(bench.run(args), timeout=30))


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_replay_agentic_sends_the_real_replies_back(fake_server, tmp_path):
    turns = [{"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}],
              "max_tokens": 3},
             {"messages": [{"role": "user", "content": "b"}], "max_tokens": 2},
             {"messages": [{"role": "user", "content": "c"}], "max_tokens": 4}]
    trace = _write(tmp_path / "a.jsonl", [{"kind": "agentic", "id": "s", "turns": turns}])
    report = _run(fake_server, trace, "--mode", "closed", "--concurrency", "1", "--api-key", "k")
    s = report["summary"]
    assert (s["num_ok"], s["num_failed"], s["num_sessions_done"]) == (3, 0, 1)
    assert s["completion_tokens"] == 9 and report["config"]["model"] == "fake-model"
    assert 0.49 < s["cache_hit_rate"] <= 0.5
    last = FakeOpenAI.seen[-1]
    assert last["path"] == "/v1/chat/completions" and last["auth"] == "Bearer k"
    assert last["stream_options"] == {"include_usage": True} and last["stream"] is True
    assert [m["content"] for m in last["messages"]] == ["sys", "a", "tok0 tok1 tok2 ", "b",
                                                        "tok0 tok1 ", "c"]
    req = report["requests"][2]
    assert req["ok"] and req["completion_tokens"] == 4 and len(req["itl_s"]) == 3
    assert req["ttft_s"] <= req["e2e_s"] and req["tpot_s"] is not None


def test_replay_errors_timeouts_completions_and_limits(fake_server, tmp_path):
    records = [{"kind": "code", "id": "c", "prompt": "code", "max_tokens": 2},
               {"kind": "chat", "id": "f", "messages": [{"role": "user", "content": "fail"}],
                "max_tokens": 2},
               {"kind": "chat", "id": "t", "messages": [{"role": "user", "content": "slow"}],
                "max_tokens": 2}]
    trace = _write(tmp_path / "m.jsonl", records)
    report = _run(fake_server, trace, "--mode", "open", "--rate", "50", "--model", "m")
    s = report["summary"]
    assert (s["num_ok"], s["num_failed"]) == (1, 2)
    errors = " | ".join(s["errors"])
    assert "HTTP 500" in errors and "boom" in errors and "timeout after 0.5 s" in errors
    assert FakeOpenAI.seen[0]["path"] == "/v1/completions"
    # --cycle with --num-requests: exactly N sent, closed loop
    trace = _write(tmp_path / "c.jsonl", records[:1])
    report = _run(fake_server, trace, "--mode", "closed", "--concurrency", "3", "--cycle",
                  "--num-requests", "7", "--model", "m")
    assert (report["summary"]["num_ok"], report["summary"]["num_failed"]) == (7, 0)


def test_duration_stops_sending_and_grace_cancels_stragglers(fake_server, tmp_path):
    slow = {"kind": "chat", "id": "t", "messages": [{"role": "user", "content": "slow"}],
            "max_tokens": 1}
    trace = _write(tmp_path / "s.jsonl", [slow])
    args = bench.parse_args(["--url", fake_server, "--trace", str(trace), "--model", "m",
                             "--request-timeout", "5", "--grace", "0.2", "--duration", "0.1",
                             "--cycle", "--mode", "closed", "--concurrency", "2"])
    t0 = time.monotonic()
    report = asyncio.run(asyncio.wait_for(bench.run(args), timeout=30))
    assert time.monotonic() - t0 < 2
    s = report["summary"]
    assert (s["num_ok"], s["num_failed"]) == (0, 2)
    assert list(s["errors"]) == ["cancelled: still running when the grace period ended"]
