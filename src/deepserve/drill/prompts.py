"""The drill's prompts: load prompts of both PD layouts, and a cache probe.

    make_prompts       3 short (colocated) + 3 long (past the PD threshold:
                       disaggregated where the node has a prefill/decode pair)
    make_probe_prompt  several full KV blocks, under the PD threshold, shares
                       no block with any other prompt (a fresh id comes first)
    make_long_prompts  six long prompts of their own (a fresh id each): KV that
                       outgrows small tiers and comes back from storage
    greedy_reference   a local engine's greedy tokens per (prompt, max_tokens),
                       cached: what a stream's tokens are checked against

Lengths are counted with the model's tokenizer when it is at hand, else a
token is assumed to cover up to 6 characters.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Callable

SHORT_PROMPTS = ("Say hi", "The capital of France is", "1, 2, 3, 4,")
LONG_UNIT = "def handler(request):\n    headers = request.headers\n    return headers\n"
PROBE_UNIT = "probe line {i}: the quick brown fox jumps over the lazy dog\n"


def make_prompts(min_long_tokens: int | None, count_tokens=None) -> list[str]:
    """Three short prompts and three long ones, longer than `min_long_tokens`
    (the PD threshold) so they go disaggregated where the node has a 1P1D pair.
    count_tokens(text) -> int when the model's tokenizer is at hand; without it
    a token is assumed to cover up to 6 characters."""
    need = (min_long_tokens or 64) + 16
    long_prompts = []
    for i, topic in enumerate(("headers", "cookies", "query")):
        unit = LONG_UNIT.replace("headers", topic)
        text = f"# module {i}\n"
        while _count(text, count_tokens) <= need:
            text += unit
        long_prompts.append(text)
    # interleaved: with concurrency 3 round robin, every wave has both kinds
    return [p for pair in zip(SHORT_PROMPTS, long_prompts) for p in pair]


def make_probe_prompt(min_long_tokens: int | None, count_tokens=None) -> str:
    """A prompt no load request shares a block with (a fresh id up front), of
    several full KV blocks yet under `min_long_tokens`, so it runs colocated."""
    limit = (min_long_tokens or 64) - 8
    text = f"# cache probe {uuid.uuid4().hex}\n"
    i = 0
    while _count(text + PROBE_UNIT.format(i=i), count_tokens) < limit and i < 64:
        text += PROBE_UNIT.format(i=i)
        i += 1
    return text


def make_long_prompts(num_tokens: int, count_tokens=None, num: int = 6) -> list[str]:
    out = []
    for i in range(num):
        unit = LONG_UNIT.replace("headers", f"field{i}")
        text = f"# long module {uuid.uuid4().hex}\n"
        while _count(text, count_tokens) < num_tokens:
            text += unit
        out.append(text)
    return out


def _count(text: str, count_tokens) -> int:
    return count_tokens(text) if count_tokens else len(text) // 6


def token_counter(model_dir: str):
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - fall back to characters
        return None
    return lambda text: len(tok.encode(text).ids)


def greedy_reference(llm) -> Callable[[str, int], list[int]]:
    """ids(prompt, max_tokens): llm's greedy tokens (EOS ignored), each computed once."""
    from deepserve import SamplingParams

    cache: dict[tuple[str, int], list[int]] = {}

    def ids(prompt: str, max_tokens: int) -> list[int]:
        if (prompt, max_tokens) not in cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            cache[prompt, max_tokens] = llm.generate([prompt], params)[0].token_ids
        return cache[prompt, max_tokens]
    return ids
