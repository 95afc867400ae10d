"""A real one-node cluster on loopback (gateway, JE, CM, two TEs on the tiny
model), driven with the `openai` client."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, TESpec

pytestmark = pytest.mark.slow  # starts process trees

LONG = "def handler(request):\n    headers = request.headers\n    return headers\n" * 12
TE_OPTIONS = {"max_num_batched_tokens": 256, "num_kv_blocks": 256}



@pytest.fixture(scope="module")
def node(tiny_model):
    config = NodeConfig.build(model=str(tiny_model), served_model="tiny", port=free_port(),
                              api_keys={"key-a": "tenant-a", "key-b": "tenant-b"},
                              startup_timeout_s=120, te_timeout_s=5,
                              tes=[TESpec(f"te{i}", "colocated", TE_OPTIONS) for i in range(2)])
    node = Node(config)
    node.start()
    yield node
    procs = list(node.procs.values())
    node.stop()
    assert all(p.poll() is not None for p in procs) and not node.run_dir.exists()
    assert _shm(node) == set()  # every TE's segments were unlinked


def _shm(node: Node) -> set[str]:
    """The node's shared-memory segments (every name carries its run id: TEs'
    deepserve-{run_id}{te}-..., the weight cache's deepserve-w{run_id}), so a
    second test run on the machine does not count."""
    return {p.name for p in Path("/dev/shm").iterdir()
            if p.name.startswith("deepserve-") and node.run_id in p.name}


def _client(node, key="key-a") -> OpenAI:
    return OpenAI(base_url=f"{node.url}/v1", api_key=key, max_retries=0, timeout=60)


def _metrics(node) -> dict:
    request = urllib.request.Request(f"{node.url}/metrics",  # keyed: not for anonymous callers
                                     headers={"Authorization": "Bearer key-a"})
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_chat_and_completion_streaming_and_not(node):
    client = _client(node)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert 1 <= chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 3
    done = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8,
                                     temperature=0)
    streamed = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


def test_repeated_prefix_is_routed_back_and_hits_the_cache(node):
    client = _client(node)
    first = client.completions.create(model="tiny", prompt=LONG + "x = 1", max_tokens=4)
    time.sleep(1.5)  # the TE reports its new blocks to the CM, which relays them to the JE
    hits = [client.completions.create(model="tiny", prompt=LONG + f"y = {i}", max_tokens=4)
            .usage.prompt_tokens_details.cached_tokens for i in range(4)]
    assert first.usage.prompt_tokens > 64
    assert all(h >= 64 for h in hits), hits  # every repeat went to the TE holding the prefix


@pytest.fixture
def one_te_node(tiny_model):
    """A node with a single TE: both tenants' requests must land on it, so only
    the salt can keep tenant b off tenant a's blocks (with two TEs, b might
    simply be routed to the TE that never saw the prompt)."""
    config = NodeConfig.build(model=str(tiny_model), served_model="tiny", port=free_port(),
                              api_keys={"key-a": "tenant-a", "key-b": "tenant-b"},
                              startup_timeout_s=120, te_timeout_s=5,
                              tes=[TESpec("te0", "colocated", TE_OPTIONS)])
    node = Node(config)
    node.start()
    try:
        yield node
    finally:
        node.stop()


def test_tenants_never_share_cached_tokens(one_te_node):
    a, b = _client(one_te_node, "key-a"), _client(one_te_node, "key-b")
    prompt = LONG + "tenant check"
    a.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = a.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    other = b.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    b_again = b.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the one TE caches
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # but not across tenants
    assert b_again.usage.prompt_tokens_details.cached_tokens > 0  # b's own entries hit


def test_disconnect_mid_stream_frees_the_kv_blocks(node):
    client = _client(node)
    stream = client.completions.create(model="tiny", prompt=LONG, max_tokens=1500, stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = _metrics(node)
        running = [v for (name, _), v in m.items() if name == "deepserve_te_requests_running"]
        usage = [v for (name, _), v in m.items() if name == "deepserve_te_kv_usage"]
        if running and usage and max(running) == 0 and max(usage) == 0:
            return
        time.sleep(0.3)
    pytest.fail(f"KV still in use after the client left: {running} {usage}")


def test_health_goes_503_when_no_te_is_up(node, request):
    with urllib.request.urlopen(f"{node.url}/health", timeout=5) as r:
        assert r.status == 200
    node.supervisor.stop()  # last test of the module: take every TE down, for good
    node.supervisor = None
    for name, p in node.procs.items():
        if name.startswith("te"):
            p.terminate()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{node.url}/health", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 503
            break
        time.sleep(0.3)
    else:
        pytest.fail("/health stayed 200 with no TE")
    with pytest.raises(Exception) as info:
        _client(node).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert getattr(info.value, "status_code", None) == 503
