"""reasoning_content split from <think> ... </think>: whole and streamed
in any chunking give the same parts."""

from __future__ import annotations

import random

import pytest

from deepserve.gateway.http.reasoning import ReasoningStream, has_reasoning, split

CASES = [
    ("<think>\nplan A</think>\n\nThe answer.", ("plan A", "The answer.")),
    ("<think>still going", ("still going", "")),
    ("Plain answer </think> text", (None, "Plain answer </think> text")),
    ("<thin", (None, "<thin")),
    ("<think></think>x", (None, "x")),
    ("", (None, "")),
]


@pytest.mark.parametrize("text, parts", CASES)
def test_split(text, parts):
    assert split(text) == parts


@pytest.mark.parametrize("text, parts", CASES)
def test_stream_equals_split_in_any_chunking(text, parts):
    rng = random.Random(0)
    for _ in range(50):
        stream, reasoning, content, pos = ReasoningStream(), "", "", 0
        while pos < len(text):
            n = rng.randint(1, 4)
            r, c = stream.feed(text[pos:pos + n])
            reasoning, content, pos = reasoning + r, content + c, pos + n
        r, c = stream.finish()
        reasoning, content = reasoning + r, content + c
        assert (reasoning.strip("\n") or None, content) == parts


def test_detection():
    assert has_reasoning("{% if enable_thinking %}<think>{% endif %}")
    assert not has_reasoning("{{ messages }}") and not has_reasoning(None)


@pytest.fixture(scope="module")
def thinking_stack(tmp_path_factory, smollm2_dir):
    """The gateway reads a chat template that thinks (a copy of SmolLM2's
    tokenizer with a <think> template); the fake backend scripts the output."""
    import json
    import shutil

    from tests.gateway.conftest import MODEL, running_stack
    smol = smollm2_dir
    model = tmp_path_factory.mktemp("thinking")
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(smol / name, model / name)
    config = json.loads((smol / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                               "{% if enable_thinking is false %}<think></think>{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with running_stack(model_dirs={MODEL: str(model)}) as stack:
        yield stack


OUTPUT = "<think>\nThe user wants the weather.</think>\n\nIt is sunny."


def test_reasoning_content_whole_and_streamed(thinking_stack):
    from tests.gateway.conftest import MODEL
    ask = [{"role": "user", "content": f"weather? [script]{OUTPUT}"}]
    client = thinking_stack.openai()
    resp = client.chat.completions.create(model=MODEL, messages=ask)
    message = resp.choices[0].message
    assert message.content == "It is sunny."
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert thought.strip("\n") == "The user wants the weather."
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
    hidden = client.chat.completions.create(model=MODEL, messages=ask,
                                            extra_body={"include_reasoning": False})
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
    assert hidden.choices[0].message.content == "It is sunny."
