"""Structured output's cost: decode step time with a JSON-schema grammar
against unconstrained decoding, at batch 1, 8 and 32, interleaved rounds
(free, grammar, free, grammar, ...) on one in-process engine; and grammar
compile times (a 20-property schema: cold, and cached), plus the one-time
start of the grammar engine (xgrammar imported, the vocabulary read) in a
fresh process.

The grammar keeps every sequence inside JSON for the whole run (an array
of at least 100 strings cannot close within --gen-len tokens), so both
sides decode the same number of steps at the same batch size. Reported:
the median decode step (every step after the prefill) per side, the ratio
grammar / free per round, and its median with min-max.

    python tools/bench_structured.py [--model models/smollm2-135m-instruct]
        [--batch-sizes 1,8,32] [--rounds 3] [--gen-len 64]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
ITEMS = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 100, "items": {"type": "string", "maxLength": 24}}}}
TWENTY = {"type": "object", "required": [f"field_{i}" for i in range(20)], "properties": {
    f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "number"},
                   {"type": "boolean"}, {"type": "array", "items": {"type": "string"}}][i % 5]
    for i in range(20)}}


def step_times(llm, batch: int, gen_len: int, structured) -> list[float]:
    from deepserve.messages.sampling import SamplingParams
    engine = llm.engine
    sampling = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True,
                              structured=structured)
    chat = [{"role": "user", "content": "List fruits as JSON."}]
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat), False)
    for i in range(batch):
        engine.add_request(ids + [i % 7 + 10], sampling)  # distinct prompts
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[2:]  # decode steps (the first ones prefill)


def compile_times(model: Path, vocab: int, eos: list[int]) -> dict:
    from deepserve.messages.sampling import StructuredOutput
    from deepserve.structured.compile import GrammarCompiler
    compiler = GrammarCompiler(model, vocab, eos)
    spec = StructuredOutput(kind="json", spec=json.dumps(TWENTY))
    t0 = time.perf_counter()
    compiler.compile(spec)
    t1 = time.perf_counter()
    compiler.compile(spec)
    t2 = time.perf_counter()
    return {"cold_ms": (t1 - t0) * 1e3, "cached_ms": (t2 - t1) * 1e3}


def grammar_start_s(model: Path, vocab: int, eos: list[int]) -> float:
    """Seconds to import xgrammar and read the vocabulary, in a fresh process
    that has torch already (as a worker has)."""
    code = ("import time, torch; t = time.perf_counter(); "
            "from deepserve.structured.compile import GrammarCompiler; "
            f"GrammarCompiler({str(model)!r}, {vocab}, {eos}); "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--model", type=click.Path(path_type=Path),
              default=ROOT / "models" / "smollm2-135m-instruct")
@click.option("--batch-sizes", default="1,8,32")
@click.option("--rounds", default=3)
@click.option("--gen-len", default=64)
def main(model: Path, batch_sizes: str, rounds: int, gen_len: int) -> None:
    from deepserve import LLM
    from deepserve.messages.sampling import StructuredOutput
    llm = LLM(str(model), max_num_batched_tokens=4096)
    cfg = llm.engine.model_config
    grammar = StructuredOutput(kind="json", spec=json.dumps(ITEMS))
    step_times(llm, 1, 4, grammar)  # the grammar engine started: not in the table
    print(f"model {model.name}, {gen_len} tokens per sequence, {rounds} rounds; "
          f"CPU: {_cpu()}")
    print("batch | free step ms (median) | grammar step ms | grammar/free per round: "
          "median (min-max)")
    for batch in [int(b) for b in batch_sizes.split(",")]:
        free, constrained, ratios = [], [], []
        for _ in range(rounds):
            f = statistics.median(step_times(llm, batch, gen_len, None))
            g = statistics.median(step_times(llm, batch, gen_len, grammar))
            free.append(f)
            constrained.append(g)
            ratios.append(g / f)
        print(f"{batch:5d} | {statistics.median(free) * 1e3:8.1f} | "
              f"{statistics.median(constrained) * 1e3:8.1f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")
    times = [compile_times(model, cfg.vocab_size, list(cfg.eos_token_ids)) for _ in range(3)]
    print("20-property schema compile ms: cold {:.1f}, cached {:.3f} (median of 3)".format(
        statistics.median(t["cold_ms"] for t in times),
        statistics.median(t["cached_ms"] for t in times)))
    print(f"grammar engine start (import + vocabulary), once per process: "
          f"{grammar_start_s(model, cfg.vocab_size, list(cfg.eos_token_ids)):.2f} s")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
