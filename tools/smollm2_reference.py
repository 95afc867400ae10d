"""Write (or `--check`) tests/model/smollm2_reference.json: what Hugging Face
transformers says about the built-in SmolLM2-135M-Instruct GGUF, for the
tests to compare our importer and engine against without running it.

    python tools/smollm2_reference.py            # rewrite the JSON
    python tools/smollm2_reference.py --check    # recompute; exit 1 if it differs

transformers reads the GGUF itself (AutoTokenizer / AutoModelForCausalLM
with gguf_file=): its own tokenizer builder and its own dequantization. The
model is loaded in bf16 (the dtype our importer stores) and run in fp32, so
both engines compute on the same weights; greedy, up to MAX_NEW_TOKENS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "model" / "smollm2_reference.json"
MAX_NEW_TOKENS = 24
TEXTS = ["Hello world", "The year 2024 had 366 days; 3.14159 is pi.", "12345 + 678 = 9,012",
         "naïve café — 日本語 😀 Ελληνικά",
         "  leading\tand\n\ntrailing   spaces  ",
         "don't I'll we've THEY'RE", "<|im_start|>user\nhi<|im_end|>\n", "x=1;\r\ny=22;  z=333"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Name three primes."}],
         [{"role": "user", "content": "Write one sentence about the sea."}]]
RAW = ["The quick brown fox", "def fibonacci(n):"]


def reference() -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "src"))
    from deepserve.model.gguf import builtin_gguf

    gguf = builtin_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.bfloat16)
    # A GGUF-loaded model refuses .float(): the same bf16 weights, copied into an fp32 one.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()})
    model.generation_config = loaded.generation_config
    chats = [{"messages": m, "text": tok.apply_chat_template(m, tokenize=False,
                                                             add_generation_prompt=True)}
             for m in CHATS]
    prompts = [tok.encode(c["text"], add_special_tokens=False) for c in chats]
    prompts += [tok.encode(t) for t in RAW]
    greedy = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        greedy.append({"prompt_ids": ids, "output_ids": out[0, len(ids):].tolist()})
    return {
        "source": {"file": gguf.name, "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
                   "transformers": transformers.__version__},
        "tokenizer": [{"text": t, "ids": tok.encode(t)} for t in TEXTS],
        "chats": chats, "max_new_tokens": MAX_NEW_TOKENS, "greedy": greedy,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    args = ap.parse_args()
    fresh = reference()
    if args.check:
        kept = json.loads(OUT.read_text())
        kept["source"].pop("transformers"), fresh["source"].pop("transformers")
        same = kept == fresh
        print(f"{OUT}: {'matches' if same else 'DIFFERS from'} transformers")
        return 0 if same else 1
    OUT.write_text(json.dumps(fresh, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
