"""Train the decode-length predictor of the PD-aware router (PAPERS.md 1.8).

    python tools/train_predictor.py [--model models/tiny] [--out conf/decode_predictor.json]
        [--num-chat 2000] [--num-code 1000] [--seed 0] [--epochs 200] [--num-buckets 8]
        [--chat-max-tokens 64-900] [--code-max-tokens 16-200] [--trace pairs.jsonl]

The pairs (prompt token ids, actual output length) come from tools/traces.py's
chat and code generators (prompt sizes: its defaults, counted with the model's
tokenizer), or from --trace, a JSON-lines file of {"prompt_token_ids": [...] |
"prompt": "..." | "messages": [...], "output_tokens": N}. Chat messages go
through the model's chat template (Tokenizer.request_ids).

The "actual output length" of a generated request is its max_tokens: our
models have random weights and the benchmarks generate with ignore_eos, so
every request runs to max_tokens. The output ranges are chosen to span
several 128-token buckets: chat 64-900 (buckets 0-7, short question, long
answer), code 16-200 (buckets 0-1, long prompt, short answer). Within a kind
max_tokens is drawn independently of the prompt, so the learnable signal is
the kind (and prompt length): the ceiling is well below 100%. With a real
model, record real output lengths and pass them with --trace.

Splits 80/20 (seeded), trains, prints held-out bucket accuracy next to the
majority-class baseline and a confusion summary, writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/traces.py

import traces  # noqa: E402

from deepserve.control.je.routing.decode_predictor import DecodeLengthPredictor, bucket_of  # noqa: E402
from deepserve.tokenizer import Tokenizer  # noqa: E402

Pair = tuple[list[int], int]


def generated_pairs(tok: Tokenizer, model_dir: str, args: argparse.Namespace) -> list[Pair]:
    rng, count = random.Random(args.seed), traces.make_counter(model_dir)
    chat_prompt = traces.parse_range(traces.DEFAULTS["chat"]["prompt_tokens"])
    code_prompt = traces.parse_range(traces.DEFAULTS["code"]["prompt_tokens"])
    records = [*traces.gen_chat(rng, args.num_chat, chat_prompt, args.chat_max_tokens, count),
               *traces.gen_code(rng, args.num_code, code_prompt, args.code_max_tokens, count)]
    pairs = []
    for r in records:
        _, ids = tok.request_ids(prompt=r.get("prompt"), messages=r.get("messages"))
        pairs.append((ids, r["max_tokens"]))
    return pairs


def trace_pairs(tok: Tokenizer, path: str) -> list[Pair]:
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if "output_tokens" not in r:
                raise SystemExit(f"{path}:{line_no}: no output_tokens")
            _, ids = tok.request_ids(prompt=r.get("prompt"), messages=r.get("messages"),
                                     prompt_token_ids=r.get("prompt_token_ids"))
            pairs.append((ids, int(r["output_tokens"])))
    return pairs


def confusion_text(counts: list[list[int]]) -> str:
    k = len(counts)
    lines = ["confusion (rows: actual bucket, cols: predicted; bucket k = [128k, 128k+128))",
             "      " + "".join(f"{j:>6}" for j in range(k)) + "   total  recall"]
    for i, row in enumerate(counts):
        total = sum(row)
        recall = f"{row[i] / total:.2f}" if total else "  - "
        lines.append(f"{i:>6}" + "".join(f"{n:>6}" for n in row) + f"{total:>8}  {recall:>6}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/tiny", help="model dir (its tokenizer)")
    ap.add_argument("--out", default="conf/decode_predictor.json")
    ap.add_argument("--num-chat", type=int, default=2000)
    ap.add_argument("--num-code", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--num-buckets", type=int, default=8)
    ap.add_argument("--chat-max-tokens", type=traces.parse_range, default=(64, 900))
    ap.add_argument("--code-max-tokens", type=traces.parse_range, default=(16, 200))
    ap.add_argument("--holdout", type=float, default=0.2, help="held-out fraction")
    ap.add_argument("--trace", default=None, help="JSONL pairs to train on instead")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    tok = Tokenizer(args.model)
    pairs = trace_pairs(tok, args.trace) if args.trace else generated_pairs(tok, args.model, args)
    random.Random(args.seed).shuffle(pairs)
    n_held = max(1, round(len(pairs) * args.holdout))
    held, train = pairs[:n_held], pairs[n_held:]
    print(f"{len(pairs)} pairs ({len(train)} train, {len(held)} held out), "
          f"tokenized in {time.perf_counter() - t0:.1f}s")
    t1 = time.perf_counter()
    pred = DecodeLengthPredictor.train(train, num_buckets=args.num_buckets, epochs=args.epochs,
                                       seed=args.seed)
    k = pred.num_buckets
    majority = max(range(k), key=[bucket_of(n, k) for _, n in train].count)
    baseline = sum(bucket_of(n, k) == majority for _, n in held) / len(held)
    print(f"trained in {time.perf_counter() - t1:.1f}s: train accuracy {pred.accuracy(train):.3f}")
    print(f"held-out bucket accuracy {pred.accuracy(held):.3f}; "
          f"majority-class baseline (bucket {majority}) {baseline:.3f}")
    print(confusion_text(pred.confusion(held)))
    pred.metadata.update(model=args.model, trace=args.trace or "traces.py chat+code",
                         num_chat=args.num_chat, num_code=args.num_code,
                         chat_max_tokens=list(args.chat_max_tokens),
                         code_max_tokens=list(args.code_max_tokens),
                         held_out_accuracy=round(pred.accuracy(held), 4),
                         baseline_accuracy=round(baseline, 4),
                         created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if args.trace:
        for key in ("num_chat", "num_code", "chat_max_tokens", "code_max_tokens"):
            pred.metadata.pop(key)
    pred.save(args.out)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
