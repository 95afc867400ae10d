"""Two models from one node, each scaled by the autoscaler: each answers with
its own weights (greedy tokens equal to the in-process engine on that model),
both go to zero TEs when idle and come back on demand, and no request is lost
on the way (DeepServe's serverless path, issue 12's "done when")."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from deepserve import LLM, SamplingParams
from deepserve.config.models import ModelSpec, ScalingSection
from deepserve.ipc.sockets import free_port
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import NodeConfig, SupervisorConfig
from tests.supervisor.test_node import _shm

pytestmark = pytest.mark.slow  # starts process trees

OPTIONS = {"max_num_batched_tokens": 128, "num_kv_blocks": 128}
IDLE_S = 6.0
PROMPTS = ["def f(x):", "Hello there", "1, 2, 3,"]


@pytest.fixture(scope="module")
def two_models(model_dirs, tmp_path_factory):
    q, l = str(model_dirs["qwen2"]), str(model_dirs["llama"])
    config = NodeConfig.build(
        port=free_port(), startup_timeout_s=120, te_timeout_s=5,
        supervisor=SupervisorConfig(log_dir=str(tmp_path_factory.mktemp("logs"))),
        models=[ModelSpec(name="q", path=q, options=OPTIONS, idle_s=IDLE_S),
                ModelSpec(name="l", path=l, options=OPTIONS, idle_s=IDLE_S)],
        scaling=ScalingSection(pool_size=1, out_cooldown_s=1.0))
    node = Node(config)
    node.start()
    yield node, {"q": q, "l": l}
    procs = list(node.procs.values())
    node.stop()
    assert all(p.poll() is not None for p in procs)
    assert _shm(node) == set()  # TEs, pods and the weight cache: nothing left


@pytest.fixture(scope="module")
def expected(two_models):
    """model -> prompt -> the in-process engine's greedy token ids (the oracle)."""
    out = {}
    for name, path in two_models[1].items():
        llm = LLM(path, num_kv_blocks=128)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out[name] = {p: llm.generate([p], params)[0].token_ids for p in PROMPTS}
        llm.shutdown()
    return out


def _ids(node, model, prompt) -> list[int]:
    """Greedy token ids through the gateway (logprobs name them), non-streamed."""
    import urllib.request
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True, "logprobs": 1,
                       "return_tokens_as_token_ids": True}).encode()
    request = urllib.request.Request(f"{node.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        tokens = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":")[1]) for t in tokens]


def _events(node, event: str) -> list[dict]:
    lines = (node.log_dir / "health.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_each_model_answers_with_its_own_weights(two_models, expected):
    node, _ = two_models
    import urllib.request
    with urllib.request.urlopen(f"{node.url}/v1/models", timeout=5) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["q", "l"]
    for model in ("q", "l"):
        for prompt in PROMPTS:
            assert _ids(node, model, prompt) == expected[model][prompt], (model, prompt)
    assert expected["q"] != expected["l"]  # the two really differ: no cross-routing passes


def test_idle_models_go_to_zero_and_come_back_losing_nothing(two_models, expected):
    node, _ = two_models
    _wait(lambda: not list(node.te_ids), IDLE_S + 40, "both models to scale in to zero")
    assert {e["details"]["model"] for e in _events(node, "scaled_in")} >= {"q", "l"}
    _wait(lambda: any(dict(node.scaler.pods).values()), 30, "a pre-warmed process")
    outs_before = len(_events(node, "scaled_out"))
    decisions_before = len(_events(node, "scale_decision"))
    results: dict[tuple[str, str, int], list[int]] = {}

    def ask(model, prompt, i):
        results[(model, prompt, i)] = _ids(node, model, prompt)
    threads = [threading.Thread(target=ask, args=(m, p, i)) for m in ("l", "q")
               for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(results) == len(threads)  # every request ended, with its answer
    for (model, prompt, _), ids in results.items():
        assert ids == expected[model][prompt], (model, prompt)
    # scaled_out is logged once the TE's stages come in, which may be just
    # after the first answers: wait for both lines, then check them
    _wait(lambda: len(_events(node, "scaled_out")) - outs_before >= 2, 20,
          "both scale-outs in the health log")
    outs = _events(node, "scaled_out")[outs_before:]
    assert sorted(e["details"]["reason"] for e in outs) == ["demand_from_zero"] * 2
    by_source = {e["details"]["source"] for e in outs}
    assert by_source & {"prewarmed", "prewarmed_cache"}, outs  # the pool served one
    for e in outs:  # every stage timed
        assert set(e["details"]["stages"]) == {"scaler_pre", "te_pre_load", "te_load",
                                              "te_post_load", "scaler_post"}
    decisions = [e for e in _events(node, "scale_decision")[decisions_before:]
                 if e["details"]["reason"] == "demand_from_zero"]
    assert len(decisions) == 2  # one per model, though three requests of each waited


def test_metrics_count_scaling_and_the_dashboard_queries_only_live_metrics(two_models):
    """The Grafana dashboard (conf/grafana) against this node's live /metrics."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    from tests.gateway.test_grafana_dashboard import dashboard_metric_names
    node, _ = two_models
    with urllib.request.urlopen(f"{node.url}/metrics", timeout=5) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families for s in f.samples}
    outs = sum(v for (name, labels), v in samples.items()
               if name == "deepserve_scale_events_total" and ("direction", "out") in labels)
    assert outs >= 4  # min_tes of both at boot, and both back from zero
    assert samples[("deepserve_scale_stage_seconds_count", (("stage", "te_load"),))] >= 4
    assert {labels for (name, labels) in samples if name == "deepserve_model_tes"} == {
        (("model", "q"),), (("model", "l"),)}
    names = {f.name for f in families}
    base = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in dashboard_metric_names()}
    assert base <= names, base - names
