"""Seeded workload traces for tools/bench_serve.py, as JSON lines.

    python tools/traces.py chat    --out chat.jsonl    [--num-requests 32]
    python tools/traces.py code    --out code.jsonl    [--num-requests 16]
    python tools/traces.py agentic --out agentic.jsonl [--num-sessions 4] [--turns 5-12]
    common: [--seed 0] [--scale 1.0] [--max-tokens LO-HI] [--tokenizer tokenizer.json|model dir]

One line per request (chat, code) or per session (agentic):

    chat     {"kind": "chat", "id", "messages": [{"role", "content"}], "max_tokens",
              "prompt_tokens_est"}
    code     {"kind": "code", "id", "prompt": "...", "max_tokens", "prompt_tokens_est"}
    agentic  {"kind": "agentic", "id",
              "turns": [{"messages": [...], "max_tokens", "append_tokens_est"}, ...]}

chat: a short question (tens of tokens), a moderate answer. code: a long
prompt of real Python (the interpreter's stdlib sources, read offline;
synthetic code if they are missing), a short answer. agentic: DualPath-style
trajectories (PAPERS.md 2.1, 2.7). Turn 0 holds the shared agent system
prompt and the task with a file of code; every later turn appends one tool
output (a file, a test log, a listing, a grep) as a user message. Replay:

    context = []
    for turn in session["turns"]:
        context += turn["messages"]; reply = chat(context, turn["max_tokens"])
        context.append({"role": "assistant", "content": reply})

so each prompt is the previous prompt + the real reply + a short append, and
most of it is a prefix-cache hit. Token counts are estimated as chars / 4
unless --tokenizer is given; --scale multiplies every token size (prompt,
context, append and max_tokens ranges). The same seed (and Python, whose
stdlib is the code source) gives the same file.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
from pathlib import Path
from typing import Callable, Iterator

WORDS = ("system cache memory request latency model token layer batch queue thread process "
         "network storage engine kernel device buffer stream vector matrix graph tree index "
         "schedule route balance prefix block policy budget profile trace sample metric error "
         "retry timeout socket message server client config deploy scale shard replica leader "
         "lock commit rollback snapshot window sort search hash merge split").split()
TOPICS = ("binary search", "garbage collection", "TCP congestion control", "B-trees",
          "the CAP theorem", "consistent hashing", "virtual memory", "attention in transformers",
          "KV caching", "Python generators", "HTTP/2 streams", "Raft leader election",
          "copy-on-write", "bloom filters", "backpressure", "vector clocks")
ASKS = ("Explain {t} to a new engineer.", "What are the trade-offs of {t}?",
        "Give me a short example that uses {t}.", "How would you test {t}?",
        "Summarise {t} in a few bullet points.", "When should I avoid {t}?")
CODE_ASKS = ("Write a docstring for the last function above.", "Explain what this code does.",
             "List the bugs you can find in this code.", "Suggest one refactoring of this code.",
             "Continue the code with the next function.")
SYSTEM_AGENT = ("You are a coding agent working in a sandboxed repository. You can run bash "
                "commands by answering with one command in a ```bash block. After each command "
                "you receive its output. Find the bug described by the user, fix it with the "
                "smallest change, run the tests, and say DONE when they pass. Think briefly "
                "before each action; never ask the user questions.")
TOOL_KINDS = ("file", "pytest", "ls", "grep")

Counter = Callable[[str], int]


def approx_tokens(text: str) -> int:
    return math.ceil(len(text) / 4)


def make_counter(tokenizer: str | None) -> Counter:
    if tokenizer is None:
        return approx_tokens
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"range {text!r} must be N or LO-HI with 0 < LO <= HI")
    return lo_i, hi_i


def scaled(rng: tuple[int, int], scale: float) -> tuple[int, int]:
    return max(1, round(rng[0] * scale)), max(1, round(rng[1] * scale))


class CodeSource:
    """Lines of Python: the stdlib's own sources, else synthetic functions."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        root = Path(sysconfig.get_paths()["stdlib"])
        self.files = [p for p in sorted(root.glob("*.py")) if p.stat().st_size > 8192]

    def lines(self) -> Iterator[str]:
        """Endless lines, starting at a def/class of a random file, file after file."""
        while True:
            if not self.files:
                yield from self._synthetic()
                continue
            path = self.rng.choice(self.files)
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
            first = self.rng.choice(starts) if starts else 0
            yield f"# file: {path.name}"
            yield from (line[:200] for line in lines[first:])

    def _synthetic(self) -> Iterator[str]:
        name = "_".join(self.rng.sample(WORDS, 2))
        args = ", ".join(self.rng.sample(WORDS, self.rng.randint(1, 3)))
        yield f"def {name}({args}):"
        for _ in range(self.rng.randint(3, 12)):
            a, b = self.rng.sample(WORDS, 2)
            yield f"    {a} = {b}.get({self.rng.randint(0, 99)}) or {a}_{b}"
        yield f"    return {name.split('_')[0]}"
        yield ""


def take(lines: Iterator[str], target: int, count: Counter) -> tuple[str, int]:
    """Whole lines until about `target` tokens; the last line is cut to fit."""
    out, used = [], 0
    for line in lines:
        n = count(line + "\n")
        if used + n > target:
            room = (target - used) * 4  # chars; exact under the chars/4 estimate
            if room > 0:
                out.append(line[:room - 1])
            break
        out.append(line)
        used += n
        if used >= target:
            break
    text = "\n".join(out)
    return text, count(text)


def prose(rng: random.Random, target: int, count: Counter) -> tuple[str, int]:
    def sentences() -> Iterator[str]:
        while True:
            words = rng.choices(WORDS, k=rng.randint(6, 14))
            yield " ".join(words).capitalize() + "."
    return take(sentences(), target, count)


def gen_chat(rng: random.Random, num: int, prompt: tuple[int, int], out: tuple[int, int],
             count: Counter) -> Iterator[dict]:
    for i in range(num):
        ask = rng.choice(ASKS).format(t=rng.choice(TOPICS))
        detail, _ = prose(rng, max(1, rng.randint(*prompt) - count(ask) - 1), count)
        content = f"{ask} {detail}"
        yield {"kind": "chat", "id": f"chat-{i}",
               "messages": [{"role": "user", "content": content}],
               "max_tokens": rng.randint(*out), "prompt_tokens_est": count(content)}


def gen_code(rng: random.Random, num: int, prompt: tuple[int, int], out: tuple[int, int],
             count: Counter) -> Iterator[dict]:
    source = CodeSource(rng)
    for i in range(num):
        ask = "\n\n# Task: " + rng.choice(CODE_ASKS) + "\n"
        code, _ = take(source.lines(), rng.randint(*prompt) - count(ask), count)
        text = code + ask
        yield {"kind": "code", "id": f"code-{i}", "prompt": text, "max_tokens": rng.randint(*out),
               "prompt_tokens_est": count(text)}


def tool_output(rng: random.Random, source: CodeSource, target: int, count: Counter) -> str:
    kind = rng.choice(TOOL_KINDS)
    if kind == "file":
        head = f"$ cat src/{rng.choice(WORDS)}.py\n"
        return head + take(source.lines(), target - count(head), count)[0]
    if kind == "pytest":
        def log() -> Iterator[str]:
            yield "$ python -m pytest -x -q"
            while True:
                a, b = rng.sample(WORDS, 2)
                status = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED"))
                yield f"tests/test_{a}.py::test_{a}_{b} {status}"
                if status == "FAILED":
                    got, want = rng.randint(0, 999), rng.randint(0, 999)
                    yield f"E   AssertionError: assert {got} == {want}"
        return take(log(), target, count)[0]
    if kind == "ls":
        def listing() -> Iterator[str]:
            yield "$ ls -l src/"
            while True:
                yield (f"-rw-r--r-- 1 agent agent {rng.randint(100, 99999):>6} "
                       f"{rng.choice(WORDS)}_{rng.choice(WORDS)}.py")
        return take(listing(), target, count)[0]
    word = rng.choice(WORDS)
    lines = (f"src/{rng.choice(WORDS)}.py:{rng.randint(1, 900)}:{line}"
             for line in source.lines() if line.strip())
    return take(_prepend(f"$ grep -rn {word} src/", lines), target, count)[0]


def _prepend(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def gen_agentic(rng: random.Random, num: int, turns: tuple[int, int], context: tuple[int, int],
                append: tuple[int, int], out: tuple[int, int], count: Counter) -> Iterator[dict]:
    source = CodeSource(rng)
    for i in range(num):
        bug = f"The {rng.choice(WORDS)} {rng.choice(WORDS)} returns the wrong value"
        task = f"Task: {bug} when the {rng.choice(WORDS)} is empty. Here is the main module:\n"
        code, _ = take(source.lines(), max(1, rng.randint(*context) - count(task)), count)
        first = [{"role": "system", "content": SYSTEM_AGENT},
                 {"role": "user", "content": task + code}]
        session = [{"messages": first, "max_tokens": rng.randint(*out),
                    "append_tokens_est": sum(count(m["content"]) for m in first)}]
        for _ in range(rng.randint(*turns) - 1):
            text = tool_output(rng, source, rng.randint(*append), count)
            session.append({"messages": [{"role": "user", "content": text}],
                            "max_tokens": rng.randint(*out), "append_tokens_est": count(text)})
        yield {"kind": "agentic", "id": f"agentic-{i}", "turns": session}


def generate(args: argparse.Namespace) -> Iterator[dict]:
    rng, count, s = random.Random(args.seed), make_counter(args.tokenizer), args.scale
    out = scaled(args.max_tokens, s)
    if args.trace == "chat":
        return gen_chat(rng, args.num_requests, scaled(args.prompt_tokens, s), out, count)
    if args.trace == "code":
        return gen_code(rng, args.num_requests, scaled(args.prompt_tokens, s), out, count)
    return gen_agentic(rng, args.num_sessions, args.turns, scaled(args.context_tokens, s),
                       scaled(args.append_tokens, s), out, count)


def write_jsonl(records, path: str | Path) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


DEFAULTS = {  # sized for a ~0.4B model on a 2-core CPU: a few minutes per trace
    "chat": dict(num_requests=32, prompt_tokens="20-80", max_tokens="64-256"),
    "code": dict(num_requests=16, prompt_tokens="1024-3072", max_tokens="16-64"),
    "agentic": dict(num_sessions=4, turns="5-12", context_tokens="400-1000",
                    append_tokens="30-300", max_tokens="16-128"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="trace", required=True)
    for name, defaults in DEFAULTS.items():
        p = sub.add_parser(name)
        p.add_argument("--out", required=True, help="JSON-lines file to write")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--scale", type=float, default=1.0, help="multiplies every token size")
        p.add_argument("--tokenizer", default=None, help="count tokens with this tokenizer")
        p.add_argument("--max-tokens", type=parse_range, default=defaults["max_tokens"],
                       help=f"output tokens per request, LO-HI (default {defaults['max_tokens']})")
        for key, value in defaults.items():
            if key == "max_tokens":
                continue
            flag = "--" + key.replace("_", "-")
            p.add_argument(flag, type=int if isinstance(value, int) else parse_range,
                           default=value, help=f"default {value}")  # str defaults go through type
    args = ap.parse_args(argv)
    if args.scale <= 0:
        ap.error("--scale must be > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    n = write_jsonl(generate(args), args.out)
    print(f"wrote {n} {args.trace} record(s) to {args.out}")


if __name__ == "__main__":
    main()
