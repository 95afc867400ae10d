"""Fuzz the gateway's HTTP API with schemathesis, against a live node.

    python tools/fuzz_api.py --url http://127.0.0.1:8000 [--api-key KEY] [--model-dir DIR]
    python tools/fuzz_api.py [--model-dir models/tiny]    # starts its own one-TE node
        [--max-examples 20] [--seed 1] [--phases coverage,fuzzing] [--out DIR]

Reads the node's /openapi.json (with the key: it is not served to anonymous
callers when api_keys are set), narrows prompt token ids to the model's
vocabulary when the model is known (the gateway cannot know it, a TE answers
400 past it), and runs `schemathesis run --checks all` over every operation:
the coverage phase (boundaries, every status, undeclared methods) and the
fuzzing phase, a bounded number of examples each. Afterwards the node must
still serve a plain completion. Exit 0 only when schemathesis found nothing,
no answer was a 5xx (counted again from its HAR log), and the node serves.

One check is swapped for a variant: positive_data_acceptance becomes
positive_data_acceptance_within_context (registered by _register_checks in
the schemathesis process this script starts), which also lets a schema-valid request past the
model's context window be answered 400 context_length_exceeded, as OpenAI
does (a limit in tokens no JSON schema can state), and a grammar or tool
choice that cannot be served be answered 400 invalid_spec. Every other 400
to valid data still fails it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

from deepserve.gateway.http.schemas import TOKEN_KEY_PATTERN

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "tiny"
FUZZ_KEY, FUZZ_TENANT = "fuzz-key", "fuzz"
TE_OPTIONS = {"max_num_batched_tokens": 256, "num_kv_blocks": 64, "max_model_len": 32}
"""The node's one TE: a short context keeps each generation short (a fuzzer
asks for max_tokens 2**31 - 1); prompts past it are refused 400
context_length_exceeded, which the check below accepts."""
_SCHEMATHESIS = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import fuzz_api; "
                 "fuzz_api._register_checks(); from schemathesis.cli import schemathesis; "
                 "sys.exit(schemathesis())")
"""The schemathesis CLI, with this file's check registered first."""
STATELESS_CODES = {"context_length_exceeded", "invalid_spec"}
"""400 codes of limits no JSON schema can state: a prompt past the model's
context (in tokens), a grammar that does not compile or a tool_choice that
names a tool the request does not give (errors.SpecError)."""
ACCEPTED = {401, 403, 404, 409, 429}
"""Beside 2xx / 3xx (and 5xx, which not_a_server_error judges): what
positive_data_acceptance takes as an answer to valid data by default."""


def _register_checks() -> None:
    import schemathesis

    @schemathesis.check
    def positive_data_acceptance_within_context(ctx, response, case):
        meta = case.meta
        status = response.status_code
        if meta is None or not meta.generation.mode.is_positive or status < 400 \
                or status >= 500 or status in ACCEPTED:
            return None
        if status == 400 and _error_code(response) in STATELESS_CODES:
            return None  # valid JSON, but past the model's context window, or a spec
        raise AssertionError(f"Valid data should have been accepted; got {status}: "
                             f"{response.text[:300]}")


def _error_code(response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None



@dataclass
class FuzzResult:
    returncode: int
    """schemathesis's exit status: 0 when no check failed."""
    output: str
    statuses: Counter = field(default_factory=Counter)
    """HTTP status -> answers, from the HAR log of every request sent."""
    still_serves: bool = False

    @property
    def num_server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.num_server_errors == 0 and self.still_serves


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def fetch_schema(url: str, api_key: str | None, vocab_size: int | None) -> dict:
    """/openapi.json, token ids narrowed to [0, vocab_size) when it is known."""
    schema = httpx.get(f"{url}/openapi.json", headers=_headers(api_key), timeout=30).json()
    if vocab_size is not None:
        _narrow_token_ids(schema["components"]["schemas"], vocab_size - 1)
    return schema


def _narrow_token_ids(node, max_id: int) -> None:
    """Every integer schema bounded by the token id maximum gets max_id
    instead, and logit_bias keys are ids below it."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("maximum") == 2**31 - 1 \
                and node.get("minimum") == 0:
            node["maximum"] = max_id
        keys = node.get("patternProperties", {})
        if TOKEN_KEY_PATTERN in keys:  # logit_bias: ids with fewer digits than max_id
            keys[f"^[0-9]{{1,{max(1, len(str(max_id)) - 1)}}}$"] = keys.pop(TOKEN_KEY_PATTERN)
        for value in node.values():
            _narrow_token_ids(value, max_id)
    elif isinstance(node, list):
        for value in node:
            _narrow_token_ids(value, max_id)


def run_schemathesis(url: str, schema: dict, out_dir: Path, api_key: str | None = None,
                     max_examples: int = 20, seed: int = 1, phases: str = "coverage,fuzzing",
                     timeout_s: float = 600.0, request_timeout_s: float = 120.0) -> FuzzResult:
    """One `schemathesis run` over `schema` against url; its HAR log in out_dir."""
    schema_path, har_path = out_dir / "openapi.json", out_dir / "fuzz.har"
    schema_path.write_text(json.dumps(schema))
    har_path.unlink(missing_ok=True)
    argv = [sys.executable, "-c", _SCHEMATHESIS, str(Path(__file__).resolve().parent),
            "run", str(schema_path), "--url", url,
            "--checks", "all", "--exclude-checks", "positive_data_acceptance",
            "--phases", phases, "--max-examples", str(max_examples),
            "--seed", str(seed), "--workers", "1", "--request-timeout", str(request_timeout_s),
            # `all` includes max_response_time (10 s by default): a speed claim a loaded
            # machine breaks; bound it by the request timeout instead
            "--max-response-time", str(request_timeout_s),
            "--no-shrink", "--report", "har", "--report-har-path", str(har_path),
            "--output-sanitize", "false"]
    for name, value in _headers(api_key).items():
        argv += ["--header", f"{name}: {value}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=out_dir)
    result = FuzzResult(proc.returncode, proc.stdout + proc.stderr)
    if har_path.exists():
        entries = json.loads(har_path.read_text())["log"]["entries"]
        result.statuses = Counter(e["response"]["status"] for e in entries)
    return result


def still_serves(url: str, api_key: str | None, model: str) -> bool:
    """A plain completion is answered 200 with text."""
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    try:
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=_headers(api_key),
                          timeout=60)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and len(resp.json().get("choices", ())) == 1


def fuzz(url: str, model: str, api_key: str | None = None, vocab_size: int | None = None,
         out_dir: Path | None = None, **options) -> FuzzResult:
    """Fuzz the node at url, then check it still serves `model`."""
    with contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dsfuzz-")))
        out_dir.mkdir(parents=True, exist_ok=True)
        schema = fetch_schema(url, api_key, vocab_size)
        result = run_schemathesis(url, schema, out_dir, api_key, **options)
        result.still_serves = still_serves(url, api_key, model)
        return result


@contextlib.contextmanager
def running_node(model_dir: Path, served_model: str = "tiny",
                 api_keys: dict[str, str] | None = None,
                 log_dir: Path | None = None) -> Iterator[object]:
    """A one-TE node on a free loopback port (deepserve.supervisor.node.Node);
    its health log and process logs stay in log_dir when given."""
    from deepserve.ipc.sockets import free_port
    from deepserve.supervisor.node import Node
    from deepserve.supervisor.node_config import NodeConfig, SupervisorConfig, TESpec

    config = NodeConfig.build(model=str(model_dir), served_model=served_model, port=free_port(),
                              api_keys=api_keys or {}, request_timeout_s=120,
                              startup_timeout_s=120, te_timeout_s=30,
                              tes=[TESpec("te0", "colocated", TE_OPTIONS)],
                              supervisor=SupervisorConfig(  # a starved CPU is no hang
                                  heartbeat_deadline_s=15, progress_deadline_s=30,
                                  log_dir=str(log_dir) if log_dir else None))
    node = Node(config)
    node.start()
    try:
        yield node
    finally:
        node.stop()


def vocab_size_of(model_dir: Path | None) -> int | None:
    if model_dir is None or not (model_dir / "config.json").exists():
        return None
    return json.loads((model_dir / "config.json").read_text()).get("vocab_size")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running gateway; default: start a one-TE node")
    parser.add_argument("--api-key", help="key for --url (a node started here uses its own)")
    parser.add_argument("--model", default="tiny", help="served model name to call")
    parser.add_argument("--model-dir", type=Path,
                        help=f"the model's directory (own node, vocabulary); default "
                             f"{DEFAULT_MODEL} when no --url")
    parser.add_argument("--max-examples", type=int, default=20, help="per operation and phase")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--phases", default="coverage,fuzzing")
    parser.add_argument("--out", type=Path, help="keep the schema and HAR log here")
    args = parser.parse_args(argv)
    options = dict(max_examples=args.max_examples, seed=args.seed, phases=args.phases,
                   out_dir=args.out)
    if args.url:
        result = fuzz(args.url, args.model, args.api_key, vocab_size_of(args.model_dir),
                      **options)
    else:
        model_dir = args.model_dir or DEFAULT_MODEL
        log_dir = args.out / "node-logs" if args.out else None
        with running_node(model_dir, args.model, {FUZZ_KEY: FUZZ_TENANT}, log_dir) as node:
            result = fuzz(node.url, args.model, FUZZ_KEY, vocab_size_of(model_dir), **options)
    print(result.output)
    print(f"statuses: {dict(sorted(result.statuses.items()))}; 5xx: "
          f"{result.num_server_errors}; still serves: {result.still_serves}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
