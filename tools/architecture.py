"""The hand-written facts docs/architecture.md is generated around: the floor
table, the rooms each room must never import, and one chat request's path.

Everything else in that doc is read from the source (module docstrings) by
tools/gen_architecture.py. The floor table lives here, not in the package:
it is a fact about the source tree that only development tools read
(tests/test_layering.py enforces it, the doc prints it), and a module inside
src/deepserve would be a room of its own that exists only to be declared.
tools/ is no package: the test and the tools load this file by path
(`load_architecture()` in tools/gen_architecture.py, or `sys.path`).
"""

from __future__ import annotations

from typing import NamedTuple

# room -> floor: a room imports only from its own room or a lower floor.
# A room is a top-level package or module of src/deepserve (its
# sub-packages belong to it); top-level modules are rooms of their own.
FLOORS = {
    "ipc": 0, "messages": 0, "actor": 0, "faults": 0, "config": 0, "errors": 0, "tokenizer": 0,
    "checkpoint": 0, "chat_template": 0, "tool_calls": 0, "private_files": 0,
    "model": 1, "cache": 1, "transfer": 1, "structured": 1,
    "worker": 2, "tiers": 2,
    "engine": 3,
    "gateway": 4, "control": 4, "supervisor": 4,
    "drill": 5, "chaos": 5, "demo": 5,
}

# DESIGN.md: the gateway, the control plane and the supervisor talk to engines
# only by messages; messages/ is the bottom floor and imports no transport.
FORBIDDEN = {
    "gateway": {"engine", "worker", "model"},
    "control": {"engine", "worker", "model"},
    "supervisor": {"engine", "worker", "model"},
    "messages": {"ipc", "actor", "faults", "config", "tokenizer", "checkpoint"},
}

FLOOR_NAMES = {
    0: "plumbing and vocabulary",
    1: "model, cache, transfer, structured outputs",
    2: "one device; the node's KV tiers",
    3: "one TE (engine)",
    4: "what callers and operators touch",
    5: "driving the system from outside",
}


class Hop(NamedTuple):
    """One message of a chat request on its way. Files are relative to
    src/deepserve; `seen` is "file:qualname" of a function that runs when the
    hop has happened (tools/trace_request.py looks for its first call)."""

    sender: str  # the process that sends
    sender_file: str | None  # where it sends from (None: outside the platform)
    message: str  # the wire type (messages/*.py), or the HTTP exchange
    transport: str  # the socket kinds, or the shared-memory ring, or HTTP
    receiver: str
    receiver_file: str | None
    seen: str
    note: str = ""


HOPS = [
    Hop("client", None, "POST /v1/chat/completions", "HTTP", "gateway",
        "gateway/http/app.py", "gateway/http/app.py:chat_completions",
        "OpenAI JSON body, stream=true"),
    Hop("gateway", "gateway/link/job_client.py", "SubmitRequest",
        "ZeroMQ PUSH -> JE inbox PULL", "job executor", "control/je/job_executor.py",
        "control/je/job_executor.py:JobExecutor._submit",
        "prompt as messages, reply_to = the gateway's reply PULL"),
    Hop("job executor", "control/je/te_links.py", "SubmitRequest",
        "ZeroMQ PUSH (Outboxes) -> tokenizer inbox PULL", "TE tokenizer",
        "engine/te/tokenizer_actor.py", "engine/te/tokenizer_actor.py:TokenizerActor._submit",
        "tokenized once by the JE, routed to one TE; reply_to passed on"),
    Hop("TE tokenizer", "engine/te/tokenizer_actor.py", "AddRequest",
        "ZeroMQ PUSH -> master requests PULL", "TE master", "engine/te/master.py",
        "engine/te/master.py:Master._add", "validated token ids, sampling"),
    Hop("TE master", "engine/te/master.py", "StepBatch",
        "shared-memory broadcast ring (ipc/shm_ring.py)", "every worker",
        "worker/worker_actor.py", "worker/model_runner.py:ModelRunner.execute",
        "encoded once, read by every rank; repeats every step"),
    Hop("worker rank 0", "worker/worker_actor.py", "StepDone",
        "ZeroMQ PUSH -> master steps PULL", "TE master", "engine/te/master.py",
        "engine/te/master.py:Master._on_step_done",
        "carries the StepOutput: each sequence's sampled token"),
    Hop("TE master", "engine/te/master.py", "StepTokens",
        "ZeroMQ PUSH -> tokenizer inbox PULL", "TE tokenizer",
        "engine/te/tokenizer_actor.py", "engine/te/tokenizer_actor.py:TokenizerActor._tokens",
        "NewTokens per request; detokenized here, stop strings found here"),
    Hop("TE tokenizer", "engine/te/tokenizer_actor.py", "RequestDelta",
        "ZeroMQ PUSH (Outboxes) -> gateway reply PULL", "gateway",
        "gateway/link/job_client.py", "gateway/link/job_client.py:JobClient._route_reply",
        "the streaming shortcut: text goes straight back, not through the JE"),
    Hop("gateway", "gateway/http/generation.py", "SSE chunk",
        "HTTP text/event-stream", "client", None, "gateway/http/generation.py:_sse",
        "chat.completion.chunk per delta, then data: [DONE]"),
]

INTRO = """\
DeepServe is one Python package, `src/deepserve/`, whose folders are the
rooms of DESIGN.md (the design, kept beside this repository). Rooms stand on
floors: a module imports only from its own room or a lower floor, and a few
rooms must never import certain others (the gateway, the control plane and the supervisor talk to engines
only by messages). `tests/test_layering.py` enforces both, and the 400-line
limit per file. Every process is an actor (`actor.py`); every message between
processes is a msgspec Struct in `messages/`, one module per channel.

This file is generated: the floor table and the request's path come from
`tools/architecture.py`, the module lines from each module's docstring (its
first paragraph, or its first sentence when that paragraph is long). After
adding, moving or redescribing a module run `python tools/gen_architecture.py`;
`tests/test_architecture_doc.py` fails while this file is stale."""

PATH_INTRO = """\
A streamed chat completion on one node, hop by hop: who sends which message
type over which socket, and the file that handles it (paths under
`src/deepserve/`). Steps 5 and 6 repeat once per generated token, and steps 7
and 8 follow each of them. `python tools/trace_request.py` starts a node,
sends one request and prints these hops with the time each was first seen."""
