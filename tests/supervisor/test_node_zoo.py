"""The families beyond Llama through a real node: PD transfer, the host tier
and prefix caching on a sliding-window Gemma 3 (q/k norms, soft caps, local
and global rope), a Qwen3-MoE, a Mistral and a Phi-3 whose every layer
slides, and a Mixtral, each against transformers' own greedy tokens on the
same checkpoint.

The KV layout is the same for every family (every layer keeps every block,
a sliding layer masks what it no longer sees), so a block that moves between
TEs or tiers means the same thing on both sides; the test shows it does."""

from __future__ import annotations

import time

import pytest
import torch

from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec
from tests.model.hf_zoo import make_hf_model
from tests.supervisor.test_node import _metrics, _shm
from tests.supervisor.test_node_tiers import client, tier_hits

pytestmark = pytest.mark.slow  # starts process trees

NEW_TOKENS = 8
PD_LEN, SHORT_LEN = 160, 90  # PD from 100 tokens on; a short prompt is 5 full blocks
TE = {"max_num_batched_tokens": 64, "num_kv_blocks": 20}  # te0 holds 3 short prompts


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 37) % 1900 + 50 for i in range(n)]


SHAPES = ["gemma3", "qwen3-moe", "mistral-window", "phi3-longrope", "mixtral"]
"""Every family that differs from Llama/Qwen in more than its config numbers
(sliding windows, soft caps, q/k norms, longrope, experts). Qwen3 dense
shares qwen3-moe's attention; Llama runs through a node in test_node_smollm2."""


@pytest.fixture(scope="module", params=SHAPES)
def zoo(request, tmp_path_factory, tiny_model):
    """(node, HF model) for one shape: te0 colocated, te1 -> te2 a PD pair,
    a host tier of 200 blocks."""
    from transformers import AutoModelForCausalLM

    model_dir = make_hf_model(tmp_path_factory.mktemp(request.param), request.param, tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = NodeConfig.build(
        model=str(model_dir), served_model="zoo", port=free_port(), startup_timeout_s=120,
        te_timeout_s=5, api_keys={"key-a": "tenant-a"}, pd_policy="threshold",
        pd_options={"min_prompt_len": 100, "max_decode_len": 10_000},
        host_cache_bytes=32 << 20, cache_cost_model=False,
        tes=(TESpec("te0", "colocated", TE), TESpec("te1", "prefill", TE),
             TESpec("te2", "decode", TE)))
    node = Node(config)
    node.start()
    yield node, hf
    node.stop()
    assert _shm(node) == set()


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def complete(node, prompt: list[int]) -> tuple[list[int], int]:
    out = client(node).completions.create(model="zoo", prompt=prompt, max_tokens=NEW_TOKENS,
                                          temperature=0, logprobs=0, extra_body={
                                              "ignore_eos": True,
                                              "return_tokens_as_token_ids": True})
    tokens = [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]
    return tokens, out.usage.prompt_tokens_details.cached_tokens


def test_pd_transfer_keeps_transformers_tokens(zoo):
    node, hf = zoo
    for seed in (0, 1):
        prompt = ids(seed, PD_LEN)
        assert complete(node, prompt)[0] == hf_greedy(hf, prompt), seed
    deadline = time.monotonic() + 10  # TEs report every 0.5 s
    while _metrics(node).get(("deepserve_kv_transfer_bytes_total", (("te_id", "te1"),)),
                             0) == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _metrics(node)[("deepserve_kv_transfer_bytes_total", (("te_id", "te1"),))] > 0


def test_a_prefix_back_from_the_host_tier_keeps_transformers_tokens(zoo):
    node, hf = zoo
    want = {seed: hf_greedy(hf, ids(seed, SHORT_LEN)) for seed in range(10, 15)}
    for seed in range(10, 15):  # 5 prompts of 6 blocks through a 20-block pool
        assert complete(node, ids(seed, SHORT_LEN)) == (want[seed], 0), seed
    tokens, cached = complete(node, ids(10, SHORT_LEN))  # left the device, in the host tier
    assert tokens == want[10] and cached == 80
    tokens, cached = complete(node, ids(14, SHORT_LEN))  # still on the device
    assert tokens == want[14] and cached == 80
    time.sleep(1.5)  # TEReports reach the gateway
    assert tier_hits(node)["host"] >= 16
