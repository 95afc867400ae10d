"""vLLM's offline engine as a long-lived subprocess of tools/bench_engine.py.

Runs under vLLM's own Python (its venv), never imports deepserve, and talks
JSON lines: the parent writes one command per line on our stdin, we answer
one line on the protocol pipe (fd given by --reply-fd; our stdout and
stderr carry vLLM's logs). Commands:

    {"cmd": "run", "prompts": [[ids...], ...], "gen_len": N}
        -> {"arrivals": [[t, ...] per request], "start": t0, "tokens": [[ids...]]}
    {"cmd": "quit"}

The first line we write is {"ready": true, "start_s": S}: S is the time
from the first import of vllm to an engine ready to serve (its load,
torch.compile and warm-up), which the bench reports beside our TE start.
Times are time.monotonic() of this process; CLOCK_MONOTONIC is system-wide
on Linux, so the parent compares them with its own.

Each run steps vLLM's LLMEngine by hand (add_request, then step() until
done) and stamps each request's tokens as step() returns them, the way
the parent stamps ours from LLM.stream().
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _engine(args):
    from vllm import LLM

    return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               enable_prefix_caching=False, seed=0)


def _run(llm, prompts: list[list[int]], gen_len: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=gen_len, min_tokens=gen_len,
                        ignore_eos=True, detokenize=True)
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
    arrivals: list[list[float]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            i = int(out.request_id)
            ids = list(out.outputs[0].token_ids)
            arrivals[i] += [now] * (len(ids) - len(tokens[i]))
            tokens[i] = ids
    return {"start": start, "arrivals": arrivals, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    t0 = time.monotonic()
    llm = _engine(args)
    _run(llm, [[5] * 16], 2)  # first request: any lazy warm-up lands here
    reply.write(json.dumps({"ready": True, "start_s": time.monotonic() - t0}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        reply.write(json.dumps(_run(llm, cmd["prompts"], cmd["gen_len"])) + "\n")


if __name__ == "__main__":
    main()
