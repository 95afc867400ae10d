"""The built-in model through a real node, as a user meets it: the node is
given the wheel's .gguf file itself (it imports it before its TEs start, a
cache hit once the model tests have run), and a chat question gets its real
answer with finish_reason "stop" over a prefill TE -> decode TE pair (the
question with the template's own system turn is long enough for PD) and
over the colocated TE (a shorter system turn), which runs the file's own
Q4_1 / Q8_0 weights (quantize = "gguf"); a prompt sent again hits the
prefix cache with the same answer."""

from __future__ import annotations

import pytest

from deepserve.ipc.sockets import free_port
from deepserve.model.gguf import builtin_gguf
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec
from tests.conftest import ROOT
from tests.supervisor.test_node import _client, _metrics, _shm
from tests.supervisor.test_node_tiers import wait_metric

pytestmark = pytest.mark.slow  # starts process trees

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TE = {"max_num_batched_tokens": 256, "num_kv_blocks": 64, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def node():
    config = NodeConfig.build(
        model=str(builtin_gguf()), port=free_port(), startup_timeout_s=180, te_timeout_s=10,
        gguf_cache_dir=str(ROOT / "models" / "gguf"), api_keys={"key-a": "tenant-a"},
        pd_policy="threshold", pd_options={"min_prompt_len": 36, "max_decode_len": 10_000},
        tes=(TESpec("te0", "colocated", {**TE, "quantize": "gguf"}), TESpec("te1", "prefill", TE),
             TESpec("te2", "decode", TE)))
    node = Node(config)
    node.start()
    yield node
    node.stop()
    assert _shm(node) == set()


def ask(node, messages, **extra):
    return _client(node).chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=messages, temperature=0, **extra)


def test_the_node_serves_the_gguf_file_under_its_name(node):
    assert [m.id for m in _client(node).models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_a_real_question_gets_its_real_answer_through_pd(node):
    out = ask(node, QUESTION)
    assert out.usage.prompt_tokens == 37  # with the template's system turn: past 36, PD
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    sent = wait_metric(node, "deepserve_kv_transfer_bytes_total", lambda v: v > 0,
                       labels=(("te_id", "te1"),))
    assert sent and sent > 0, {k: v for k, v in _metrics(node).items() if "transfer" in k[0]}
    again = ask(node, QUESTION)
    assert again.choices[0].message.content == out.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # two full blocks


def test_a_shorter_prompt_on_the_colocated_te_streams_its_answer(node):
    system = {"role": "system", "content": "You are a helpful assistant."}  # replaces the
    stream = ask(node, [system, *QUESTION], stream=True,  # template's longer system turn
                 stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == 27  # short of 36: colocated
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text, text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
