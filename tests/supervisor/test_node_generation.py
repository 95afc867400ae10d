"""A real node on a model with generation defaults: a request that omits
max_tokens gets the rest of its context (max_model_len - prompt tokens), on
both endpoints, streamed or not, with n > 1; its omitted temperature is the
model's (0 here: every choice is the same greedy text)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec
from tests.engine.test_generation_defaults import variant

pytestmark = pytest.mark.slow  # starts a process tree

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    """One TE; the model has no EOS id at all, so only the context ends a request."""
    path = variant(tiny_model, tmp_path_factory.mktemp("gen") / "m", temperature=0.0,
                   eos_token_id=[])
    config_json = json.loads((path / "config.json").read_text())
    config_json.pop("eos_token_id")
    (path / "config.json").write_text(json.dumps(config_json))
    options = {"max_num_batched_tokens": 256, "num_kv_blocks": 64, "max_model_len": MAX_MODEL_LEN}
    node = Node(NodeConfig.build(model=str(path), served_model="gen", port=free_port(),
                                 startup_timeout_s=120, te_timeout_s=5,
                                 tes=[TESpec("te0", "colocated", options)]))
    node.start()
    yield node
    node.stop()


def _client(node) -> OpenAI:
    return OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_without_max_tokens_fills_the_context(node):
    resp = _client(node).chat.completions.create(
        model="gen", messages=[{"role": "user", "content": "Hello there"}], n=2)
    left = MAX_MODEL_LEN - resp.usage.prompt_tokens
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]
    assert resp.usage.completion_tokens == 2 * left and left > 16
    assert resp.choices[0].message.content == resp.choices[1].message.content  # greedy


def test_streamed_completion_without_max_tokens_fills_the_context(node):
    chunks = list(_client(node).completions.create(
        model="gen", prompt="def f(x):", n=2, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == ["length", "length"]
    assert usage.completion_tokens == 2 * (MAX_MODEL_LEN - usage.prompt_tokens)


def test_stop_token_ids_end_a_request_at_that_token_even_with_ignore_eos(node):
    client = _client(node)
    free = client.completions.create(model="gen", prompt="def f(x):", max_tokens=8, logprobs=0,
                                     extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.split(":")[1]) for t in free.choices[0].logprobs.tokens]  # "token_id:N"
    assert len(ids) == 8 and free.choices[0].finish_reason == "length"
    stop_at = ids.index(ids[3]) + 1  # the first place that token comes out
    stopped = client.completions.create(model="gen", prompt="def f(x):", max_tokens=8,
                                        extra_body={"stop_token_ids": [ids[3]],
                                                    "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == stop_at  # the stop token counts, as EOS does
