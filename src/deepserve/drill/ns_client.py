"""An HTTP client for the cluster tests and the partition-head drill, run inside
a host namespace (drill/netns.py: the root namespace reaches no host's address).

    python -m deepserve.drill.ns_client wait URL NUM_TES TIMEOUT_S
        polls URL/health until it lists NUM_TES TEs; prints {"num_tes": n}
    python -m deepserve.drill.ns_client get URL PATH KEY
        prints the body of GET URL/PATH (Authorization: Bearer KEY)
    python -m deepserve.drill.ns_client generate URL KEY MODEL MAX_TOKENS PROMPTS_JSON
        streams one greedy completion per prompt, all at once (a thread each);
        prints {"event": "streaming"} once every stream has its first token,
        then one JSON line: [{"ids": [...], "finish_reason": ..., "finishes": n,
        "error": ...}] (finishes: chunks that carried a finish_reason; one per stream)

Token ids come from `logprobs` ("token_id:<id>": return_tokens_as_token_ids), so a
test compares them with a local greedy run and sees a repeated token.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx

REQUEST_TIMEOUT_S = 120.0


def wait(url: str, num_tes: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    listed = None
    while time.monotonic() < deadline:
        try:
            listed = httpx.get(f"{url}/health", timeout=2).json().get("num_tes")
            if listed is not None and listed >= num_tes:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    print(json.dumps({"num_tes": listed}), flush=True)


def _stream(url: str, key: str, model: str, max_tokens: int, prompt: str, out: dict,
            first: threading.Event) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "return_tokens_as_token_ids": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read().decode()[:300]}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    out["error"] = chunk["error"].get("message", str(chunk["error"]))
                    continue
                for choice in chunk.get("choices", []):
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    out["ids"].extend(int(t.split(":")[1]) for t in tokens)
                    if tokens:
                        first.set()
                    if choice.get("finish_reason"):
                        out["finish_reason"] = choice["finish_reason"]
                        out["finishes"] += 1
    except (httpx.HTTPError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        first.set()


def generate(url: str, key: str, model: str, max_tokens: int, prompts: list[str]) -> None:
    outs = [{"ids": [], "finish_reason": None, "finishes": 0, "error": None} for _ in prompts]
    firsts = [threading.Event() for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(url, key, model, max_tokens, p, o, f))
               for p, o, f in zip(prompts, outs, firsts)]
    for t in threads:
        t.start()
    for f in firsts:
        f.wait(REQUEST_TIMEOUT_S)
    print(json.dumps({"event": "streaming"}), flush=True)
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    print(json.dumps(outs), flush=True)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "wait":
        wait(args[0], int(args[1]), float(args[2]))
    elif command == "get":
        print(httpx.get(f"{args[0]}{args[1]}", timeout=10,
                        headers={"Authorization": f"Bearer {args[2]}"}).text, flush=True)
    elif command == "post":  # URL PATH KEY JSON: {"status": ..., "body": ...}
        r = httpx.post(f"{args[0]}{args[1]}", json=json.loads(args[3]), timeout=60,
                       headers={"Authorization": f"Bearer {args[2]}"})
        print(json.dumps({"status": r.status_code, "body": r.json()}), flush=True)
    elif command == "generate":
        generate(args[0], args[1], args[2], int(args[3]), json.loads(args[4]))
    else:
        raise SystemExit(f"unknown command {command!r}")
