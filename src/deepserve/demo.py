"""The main job until the HTTP gateway exists: load a model, generate for a
handful of prompts (one through the chat template), print texts and speed."""

from __future__ import annotations

import time

import click

from deepserve import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass LRUCache:",
    "# Parse a configuration file and return a dict\n",
    "The serving platform routes each request to",
]
CHAT = [{"role": "user", "content": "Write a function that reverses a string."}]


@click.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Hugging Face model directory.")
@click.option("--max-tokens", default=48, show_default=True, help="Tokens per prompt.")
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--dtype", default=None, help="float32 or bfloat16 (default: the model's).")
def main(model: str, max_tokens: int, temperature: float, dtype: str | None) -> None:
    started = time.perf_counter()
    llm = LLM(model, dtype=dtype)
    click.echo(f"loaded {model} in {time.perf_counter() - started:.2f} s")
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
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
