"""The main job until the HTTP gateway exists: start a TE (in-process, or as
processes from a conf/ file), generate for a handful of prompts (one through
the chat template), print the texts and the speed, stop the TE."""

from __future__ import annotations

import dataclasses
import signal
import time

import click

from deepserve.config import EngineConfig, load_config

PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass LRUCache:",
    "# Parse a configuration file and return a dict\n",
    "The serving platform routes each request to",
]
CHAT = [{"role": "user", "content": "Write a function that reverses a string."}]


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through `finally`, which stops the TE


@click.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False),
              help="Hugging Face model directory (in-process TE).")
@click.option("--conf", type=click.Path(exists=True, dir_okay=False),
              help="TOML file with an [engine] table (e.g. conf/engine.toml).")
@click.option("--max-tokens", default=48, show_default=True, help="Tokens per prompt.")
@click.option("--temperature", default=0.0, show_default=True)
def main(model: str | None, conf: str | None, max_tokens: int, temperature: float) -> None:
    from deepserve import LLM, SamplingParams

    if (model is None) == (conf is None):
        raise click.UsageError("give exactly one of --model and --conf")
    config = load_config(conf) if conf else EngineConfig(model=model)
    signal.signal(signal.SIGTERM, _sigterm)
    started = time.perf_counter()
    options = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    with LLM(config.model, **options) as llm:
        mode = f"processes, tp={config.tp}" if config.processes else "in-process"
        click.echo(f"TE up ({mode}) on {config.model} in {time.perf_counter() - started:.2f} s")
        _run(llm, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0))


def _run(llm, sampling) -> None:
    started = time.perf_counter()
    outputs = llm.generate(PROMPTS, sampling) + llm.chat(CHAT, sampling)
    elapsed = time.perf_counter() - started
    for out in outputs:
        click.echo(f"\n--- prompt ({len(out.prompt_token_ids)} tokens): {out.prompt!r}")
        click.echo(f"+++ {len(out.token_ids)} tokens, finish={out.finish_reason}: {out.text!r}")
    num_generated = sum(len(o.token_ids) for o in outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    click.echo(f"\n{len(outputs)} requests, {num_prompt} prompt + {num_generated} generated "
               f"tokens in {elapsed:.2f} s: {num_generated / elapsed:.1f} generated tokens/s")


if __name__ == "__main__":
    main()
