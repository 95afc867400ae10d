"""A real node with one colocated TE and a 1P1D pair: the job executor sends
long prompts with short outputs through the pair, the rest to the colocated
TE, and the caller cannot tell (same greedy tokens, one stream)."""

from __future__ import annotations

import time

import pytest

from deepserve import LLM, SamplingParams
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec
from deepserve.ipc.sockets import free_port
from tests.supervisor.test_node import _client, _metrics, _shm

pytestmark = pytest.mark.slow  # starts process trees

LONG = "def handler(request):\n    headers = request.headers\n    return headers\n" * 12
SHORT = "Say hi"
TE_OPTIONS = {"max_num_batched_tokens": 128, "num_kv_blocks": 128}


@pytest.fixture(scope="module")
def pd_node(tiny_model):
    config = NodeConfig.build(
        model=str(tiny_model), served_model="tiny", port=free_port(), startup_timeout_s=120,
        te_timeout_s=5, pd_policy="threshold",
        pd_options={"min_prompt_len": 100, "max_decode_len": 10_000},  # long prompt: PD
        tes=(TESpec("te0", "colocated", TE_OPTIONS), TESpec("te1", "prefill", TE_OPTIONS),
             TESpec("te2", "decode", TE_OPTIONS)))
    node = Node(config)
    node.start()
    yield node
    node.stop()
    assert _shm(node) == set()


def test_long_prompts_go_disaggregated_with_colocated_tokens(pd_node, tiny_model):
    llm = LLM(str(tiny_model), num_kv_blocks=256)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    client = _client(pd_node)
    for prompt in (LONG, SHORT, LONG + "x"):
        want = llm.generate([prompt], params)[0].token_ids
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                           temperature=0, logprobs=1, stream=True,
                                           extra_body={"return_tokens_as_token_ids": True})
        ids = [int(t.split(":")[1]) for chunk in stream for c in chunk.choices
               if c.logprobs for t in c.logprobs.tokens]
        assert ids == want, prompt[:20]
    llm.shutdown()
    deadline = time.monotonic() + 5  # TEs report every 0.5 s
    while True:
        m = _metrics(pd_node)
        sent = m.get(("deepserve_kv_transfer_bytes_total", (("te_id", "te1"),)), 0)
        count = m.get(("deepserve_kv_transfer_seconds_count", ()), 0)
        if count >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sent > 0, {k: v for k, v in m.items() if "transfer" in k[0]}
    assert count >= 2
    # te0 served only the short prompt: its KV usage shows no long prompt.
    assert ("deepserve_kv_transfer_bytes_total", (("te_id", "te0"),)) not in m
