"""One timed batch through each engine tools/bench_engine.py compares.

Every run yields the same summary, from per-request token arrival times:
ttft_s / tpot_s (medians over requests), prefill_s (start -> every request
has its first token: the whole-batch prefill), decode_step_s (from then on:
batch size x window / tokens that arrived in it) and the first token ids.

  * ours: deepserve.LLM.stream (in-process or a TE of processes);
  * vLLM: tools/vllm_offline.py in vLLM's own venv, a long-lived child
    (started once, ~minutes of torch.compile; runs sent as JSON lines);
  * Hugging Face transformers' generate() (optional).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}


def benchmark_prompts(vocab_size: int, sizes: list[int], prompt_len: int
                      ) -> dict[int, list[list[int]]]:
    """batch size -> its prompts: random token ids (seed 0, drawn in the order
    of sizes), the same for every engine and round; tests reuse them."""
    gen = torch.Generator().manual_seed(0)
    return {b: torch.randint(100, vocab_size, (b, prompt_len), generator=gen).tolist()
            for b in sizes}


def summarize(start: float, arrivals: list[list[float]], tokens: list[list[int]]) -> dict:
    """arrivals[i]: when each output token of request i was seen."""
    first = [a[0] for a in arrivals]
    gen_len = len(arrivals[0])
    phase_start = max(first)
    phase_end = max(a[-1] for a in arrivals)
    num_decode = sum(1 for a in arrivals for t in a if t > phase_start)
    return {"ttft_s": statistics.median(f - start for f in first),
            "tpot_s": statistics.median((a[-1] - a[0]) / (gen_len - 1) for a in arrivals),
            "prefill_s": phase_start - start,
            "decode_step_s": len(arrivals) * (phase_end - phase_start) / max(num_decode, 1),
            "first_tokens": [t[:8] for t in tokens]}


def run_ours(llm, prompts: list[list[int]], gen_len: int) -> dict:
    from deepserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    arrivals = {}
    tokens = {}
    start = time.monotonic()
    for out in llm.stream(prompts, sp):
        now = time.monotonic()
        seen = arrivals.setdefault(out.request_id, [])
        seen += [now] * (len(out.token_ids) - len(seen))
        tokens[out.request_id] = list(out.token_ids)
    ids = list(arrivals)
    assert len(ids) == len(prompts) and all(len(arrivals[i]) == gen_len for i in ids)
    return summarize(start, [arrivals[i] for i in ids], [tokens[i] for i in ids])


class VllmOffline:
    """vLLM's LLM engine in a child process of its own venv (tools/vllm_offline.py)."""

    def __init__(self, python: str, model: Path, dtype: str, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, log_path: Path):
        read_fd, write_fd = os.pipe()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(TOOLS / "vllm_offline.py"), "--model", str(model), "--dtype", dtype,
             "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
             "--max-num-batched-tokens", str(max_num_batched_tokens),
             "--reply-fd", str(write_fd)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True,
            pass_fds=(write_fd,), env={**os.environ, **VLLM_ENV}, cwd="/")
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        ready = self._reply()
        self.start_s = ready["start_s"]

    def _reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"vLLM exited (code {self.proc.poll()}); see {self.log.name}")
        return json.loads(line)

    def run(self, prompts: list[list[int]], gen_len: int) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "run", "prompts": prompts,
                                          "gen_len": gen_len}) + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        return summarize(r["start"], r["arrivals"], r["tokens"])

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_hf(model, prompts: list[list[int]], gen_len: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.monotonic())
            return scores

    ids = torch.tensor(prompts)
    start = time.monotonic()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=gen_len, min_new_tokens=gen_len,
                             logits_processor=LogitsProcessorList([Stamp()]), pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + gen_len and len(stamps) == gen_len
    # Stamp k comes with the logits of token k: every request gets it then.
    return summarize(start, [stamps] * len(prompts), out[:, ids.shape[1]:].tolist())
