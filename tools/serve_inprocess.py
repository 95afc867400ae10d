"""Our in-process engine behind a minimal OpenAI completions server (benchmarks only).

tools/bench_serving_vllm.py runs this beside our node and `vllm serve`, with
the same client (`vllm bench serve`), so that "our gateway against our
engine" is a same-run ratio: this server is the engine with no front door
(no gateway, JE, tokenizer process or sockets), the floor the node's path
is measured against. One thread owns the LLMEngine and steps it whenever a
request is open; the asyncio side only queues requests and relays outputs.

    python tools/serve_inprocess.py --model models/small --port 8124 [--dtype bfloat16]

Serves POST /v1/completions (text or token-id prompt, max_tokens,
temperature, top_p, ignore_eos, stream with stream_options.include_usage),
GET /v1/models and /health. Not the product's API: bad input is a 400 with
the engine's message, nothing more.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid

import click
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepserve import SamplingParams
from deepserve.config import EngineConfig
from deepserve.engine.api.llm_engine import LLMEngine


class EngineThread:
    """The LLMEngine's one owner: adds, aborts and steps on its own thread."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.inbox: queue.Queue = queue.Queue()
        self.outputs: dict[str, asyncio.Queue] = {}
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, prompt, sampling: SamplingParams) -> tuple[str, asyncio.Queue]:
        request_id = uuid.uuid4().hex
        out: asyncio.Queue = asyncio.Queue()
        self.outputs[request_id] = out
        self.inbox.put(("add", request_id, prompt, sampling))
        return request_id, out

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id, None, None))

    def _run(self) -> None:
        while not self.stopped:
            busy = self.engine.has_unfinished_requests()
            try:
                while True:
                    kind, request_id, prompt, sampling = self.inbox.get(
                        block=not busy, timeout=None if busy else 0.1)
                    self._take(kind, request_id, prompt, sampling)
                    busy = True
            except queue.Empty:
                pass
            if self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    self._deliver(out.request_id, out)

    def _take(self, kind, request_id, prompt, sampling) -> None:
        if kind == "abort":
            self.engine.abort_request(request_id)
            return
        try:
            self.engine.add_request(prompt, sampling, request_id=request_id)
        except ValueError as e:  # InvalidRequestError
            self._deliver(request_id, e)

    def _deliver(self, request_id: str, item) -> None:
        out = self.outputs.get(request_id)
        if out is not None:
            self.loop.call_soon_threadsafe(out.put_nowait, item)


def make_app(model: str, engine_options: dict) -> FastAPI:
    app = FastAPI()
    state: dict = {}
    name = engine_options.pop("served_model")

    @app.on_event("startup")
    async def _start() -> None:
        engine = LLMEngine(EngineConfig.from_options(model, **engine_options))
        state["engine"] = EngineThread(engine, asyncio.get_running_loop())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        sampling = SamplingParams(max_tokens=int(body.get("max_tokens") or 16),
                                  temperature=float(body.get("temperature", 1.0)),
                                  top_p=float(body.get("top_p", 1.0)),
                                  ignore_eos=bool(body.get("ignore_eos", False)))
        engine: EngineThread = state["engine"]
        request_id, out = engine.submit(body["prompt"], sampling)
        header = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                  "model": name}

        async def results():
            try:
                while True:
                    item = await out.get()
                    if isinstance(item, Exception):
                        raise item
                    yield item
                    if item.finished:
                        return
            finally:
                engine.outputs.pop(request_id, None)
                if not engine.stopped:
                    engine.abort(request_id)

        if not body.get("stream"):
            try:
                last = None
                async for last in results():
                    pass
            except ValueError as e:
                return JSONResponse({"error": {"message": str(e)}}, status_code=400)
            return {**header, "choices": [{"index": 0, "text": last.text,
                                           "finish_reason": last.finish_reason}],
                    "usage": _usage(last)}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            last = None
            try:
                async for last in results():
                    chunk = {**header, "choices": [{"index": 0, "text": last.delta,
                                                    "finish_reason": last.finish_reason}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            except ValueError as e:
                yield f"data: {json.dumps({'error': {'message': str(e)}})}\n\n"
            if include_usage and last is not None:
                yield f"data: {json.dumps({**header, 'choices': [], 'usage': _usage(last)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _usage(out) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@click.command()
@click.option("--model", required=True)
@click.option("--served-model", default=None, help="the name /v1/models lists (default: dir name)")
@click.option("--port", default=8124)
@click.option("--dtype", default="bfloat16")
@click.option("--max-num-batched-tokens", default=2048)
@click.option("--max-num-seqs", default=256)
@click.option("--kv-cache-memory", default=512 << 20)
def main(model, served_model, port, dtype, max_num_batched_tokens, max_num_seqs,
         kv_cache_memory):
    from pathlib import Path

    options = dict(served_model=served_model or Path(model).name, dtype=dtype,
                   enable_prefix_caching=False, max_num_batched_tokens=max_num_batched_tokens,
                   max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory)
    uvicorn.run(make_app(model, options), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
