"""Tensor parallelism: two gloo ranks in spawned processes sample what tp=1 samples.

One pair of child processes serves every architecture (process start-up and
`import torch` dominate the cost): the tiny llama/qwen2 models and every
hf_zoo shape whose heads split in two (sliding windows, Gemma's soft caps and
local/global rope, Phi-3's fused checkpoint tensors, both MoE namings). The
parent runs the same greedy steps at tp=1 and compares token ids; the
longest prompt passes every sliding window (16 and 24 tokens). For MoE each
rank also reports the experts its router picked in every sparse layer: both
ranks and tp=1 must route identically (the router is replicated and reads the
all-reduced hidden states). A shape whose heads do not split is refused at
load, before any process starts. A child's exception comes back through the
queue with its traceback; a hung or crashed child fails the test instead of
hanging it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue as queue_mod
import shutil
import time
import traceback

import pytest
import torch

from deepserve.ipc.sockets import free_port
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import NewSeq, ScheduledSeq, StepBatch
from deepserve.model.loader import load_model
from deepserve.model.moe import SparseMoE
from deepserve.model.parallel import (TensorParallel, destroy_tensor_parallel,
                                      init_tensor_parallel)
from deepserve.worker.model_runner import ModelRunner
from tests.model.hf_zoo import SHAPES

pytestmark = pytest.mark.slow  # starts process trees

TP = 2
PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], [1200, 3, 64, 64, 811, 2, 19, 450, 31, 8, 600],
           [900, 14, 250], [(i * 53 + 11) % 1900 + 50 for i in range(30)]]  # past every window
NUM_DECODE_STEPS = 10
BLOCK_SIZE = 4  # small, so every sequence spans several blocks
BLOCKS_PER_SEQ = 10  # covers 30 + 10 tokens
CHILD_TIMEOUT_S = 120  # ten models loaded and run in turn, on two shared cores


def _splits(shape: str) -> bool:
    """Whether hf_zoo's shape has query and KV heads that TP ranks can share."""
    fields = SHAPES[shape][1]
    return all(fields[k] % TP == 0 for k in ("num_attention_heads", "num_key_value_heads"))


ZOO_TP = [s for s in SHAPES if _splits(s)]
ZOO_REFUSED = [s for s in SHAPES if not _splits(s)]
ZOO_MOE = [s for s in ZOO_TP if SHAPES[s][0] in ("qwen3_moe", "mixtral")]


def _block_table(seq_index: int, num_tokens: int) -> list[int]:
    """Fixed disjoint blocks per sequence; block 0 stays unused (it pads tables)."""
    first = 1 + seq_index * BLOCKS_PER_SEQ
    return list(range(first, first + -(-num_tokens // BLOCK_SIZE)))


def _greedy_run(runner: ModelRunner) -> list[list[int]]:
    """A prefill step of all prompts, then NUM_DECODE_STEPS decode steps; the sampled ids."""
    greedy = SamplingParams(temperature=0, max_tokens=NUM_DECODE_STEPS + 1)
    tokens = [list(p) for p in PROMPTS]
    seqs = [ScheduledSeq(i, 0, p, _block_table(i, len(p)), True) for i, p in enumerate(tokens)]
    new = [NewSeq(i, greedy) for i in range(len(tokens))]
    batch = StepBatch(0, seqs, new)
    for step in range(1, NUM_DECODE_STEPS + 2):
        for sampled in runner.execute(batch).sampled:
            tokens[sampled.seq_id].append(sampled.token_id)
        batch = StepBatch(step, [ScheduledSeq(i, len(t) - 1, t[-1:], _block_table(i, len(t)), True)
                                 for i, t in enumerate(tokens)])
    return [t[len(p):] for t, p in zip(tokens, PROMPTS)]


def _record_routing(model) -> list[list[list[int]]]:
    """Make every SparseMoE of model append the experts it picks, (T, k) per call,
    to its own list; return the lists (one per sparse layer)."""
    picks = []
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        seen: list[list[int]] = []

        def route(x, _route=moe.route, _seen=seen):
            experts, weights = _route(x)
            _seen.extend(experts.tolist())
            return experts, weights

        moe.route = route
        picks.append(seen)
    return picks


def _run_model(model) -> dict:
    """Greedy tokens, routing and the local shapes of one loaded model (any rank)."""
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    routing = _record_routing(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    experts = mlp.gate_up if isinstance(mlp, SparseMoE) else None
    return {"tokens": _greedy_run(runner), "routing": routing,
            "kv_pool": tuple(runner.kv_pool.shape),
            "qkv": tuple(attn.qkv_proj.weight.shape), "o_proj": tuple(attn.o_proj.weight.shape),
            "experts": None if experts is None else tuple(experts.shape)}


def _rank_main(rank: int, port: int, model_dirs: dict[str, str], results: mp.Queue) -> None:
    """One tp rank (child process): load each model's shard, run the steps, report."""
    try:
        torch.set_num_threads(1)
        tp = init_tensor_parallel(rank, TP, f"tcp://127.0.0.1:{port}", timeout_s=30)
        out = {arch: _run_model(load_model(model_dir, tp=tp))
               for arch, model_dir in model_dirs.items()}
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - the parent shows it as the test failure
        results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_tensor_parallel()



def _collect(results: mp.Queue, procs: list, deadline: float) -> dict:
    """rank -> its result; a string describing the first failure instead, if any."""
    got: dict[int, dict] = {}
    while len(got) < len(procs):
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                return f"child died without reporting: (rank, exit code) {dead}"
            if time.monotonic() > deadline:
                return f"children hung: no result after {CHILD_TIMEOUT_S} s from ranks " \
                       f"{sorted(set(range(len(procs))) - set(got))}"
            continue
        if status != "ok":
            return f"rank {rank} failed:\n{payload}"
        got[rank] = payload
    return got


def _run_ranks(model_dirs: dict[str, str]) -> dict | str:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, model_dirs, results), daemon=True)
             for r in range(TP)]
    for p in procs:
        p.start()
    outcome: dict | str = "interrupted"
    try:
        outcome = _collect(results, procs, time.monotonic() + CHILD_TIMEOUT_S)
        return outcome
    finally:
        _stop(procs, grace_s=5 if isinstance(outcome, dict) else 0.5)


def _stop(procs: list, grace_s: float) -> None:
    """Join the children; kill any still running after grace_s (e.g. blocked in a collective)."""
    stop_by = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, stop_by - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _with_attention_bias(src, dst):
    """A llama copy with attention_bias: q/k/v biases (sharded) and an o_proj bias
    (must be added once, not once per rank)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["attention_bias"] = True
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight",
                                                   "v_proj.weight", "o_proj.weight"))]:
        rows = tensors[name].shape[0]
        tensors[name[:-len("weight")] + "bias"] = 0.5 * torch.randn(rows, generator=gen)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def tp_model_dirs(model_dirs, zoo_dirs, tmp_path_factory) -> dict[str, str]:
    biased = _with_attention_bias(model_dirs["llama"], tmp_path_factory.mktemp("tp") / "llama")
    return {"llama": str(model_dirs["llama"]), "qwen2": str(model_dirs["qwen2"]),
            "llama_attention_bias": str(biased), **{s: str(zoo_dirs[s]) for s in ZOO_TP}}


@pytest.fixture(scope="module")
def tp1(tp_model_dirs) -> dict:
    """arch -> what the whole model (tp=1, this process) gives on the same steps."""
    return {arch: _run_model(load_model(d)) for arch, d in tp_model_dirs.items()}


@pytest.fixture(scope="module")
def tp2(tp_model_dirs) -> dict | str:
    """rank -> arch -> what that rank saw; or the failure, reported by each test."""
    return _run_ranks(tp_model_dirs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_attention_bias", *ZOO_TP])
def test_tp2_samples_the_same_tokens_as_tp1(arch, tp1, tp2):
    if isinstance(tp2, str):
        pytest.fail(tp2, pytrace=False)
    expected = tp1[arch]["tokens"]
    assert tp2[0][arch]["tokens"] == expected
    assert tp2[1][arch]["tokens"] == expected  # SPMD: every rank samples the same


@pytest.mark.parametrize("arch", ZOO_MOE)
def test_tp2_ranks_route_every_token_as_tp1(arch, tp1, tp2):
    if isinstance(tp2, str):
        pytest.fail(tp2, pytrace=False)
    expected = tp1[arch]["routing"]
    fields = SHAPES[arch][1]
    num_sparse = fields["num_hidden_layers"] - len(fields.get("mlp_only_layers", ()))
    # one pick per token of every step: the prompts', then one per sequence per decode step
    num_picks = sum(map(len, PROMPTS)) + len(PROMPTS) * NUM_DECODE_STEPS
    assert [len(layer) for layer in expected] == [num_picks] * num_sparse
    assert tp2[0][arch]["routing"] == expected
    assert tp2[1][arch]["routing"] == expected


@pytest.mark.parametrize("arch", ZOO_TP)
def test_tp2_zoo_ranks_hold_half_of_every_layer(arch, tp2):
    if isinstance(tp2, str):
        pytest.fail(tp2, pytrace=False)
    _, fields = SHAPES[arch]
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    hidden, layers = fields["hidden_size"], fields["num_hidden_layers"]
    head_dim = fields.get("head_dim", hidden // heads)
    for rank in range(TP):
        seen = tp2[rank][arch]
        assert seen["kv_pool"] == (2, layers, kv_heads // TP, 64, BLOCK_SIZE, head_dim)
        assert seen["qkv"] == ((heads + 2 * kv_heads) // TP * head_dim, hidden)
        assert seen["o_proj"] == (hidden, heads // TP * head_dim)
        if seen["experts"] is not None:  # layer 0 is sparse in both MoE shapes
            num = fields.get("num_experts") or fields["num_local_experts"]
            inter = fields.get("moe_intermediate_size") or fields["intermediate_size"]
            assert seen["experts"] == (num, 2 * inter // TP, hidden)


def test_zoo_shapes_that_split_at_tp2():
    """The shapes above, named: a zoo change that stops splitting fails here, not silently."""
    assert ZOO_TP == ["qwen3-gqa4", "mistral-window", "gemma3", "phi3-longrope", "qwen3-moe",
                      "mixtral", "llama-yarn"]
    assert ZOO_MOE == ["qwen3-moe", "mixtral"]


@pytest.mark.parametrize("shape", ZOO_REFUSED)
def test_zoo_shape_whose_heads_do_not_split_is_refused(shape, zoo_dirs):
    with pytest.raises(ValueError, match=r"tp=2 does not divide num_(kv_)?heads=(1|3)\b"):
        load_model(zoo_dirs[shape], tp=TensorParallel(0, TP))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_ranks_hold_local_heads(arch, tp2):
    if isinstance(tp2, str):
        pytest.fail(tp2, pytrace=False)
    # tiny: 4 layers, 4 heads, 2 KV heads, head_dim 32, hidden 128 -> 2 + 1 + 1 heads per rank
    for rank in range(TP):
        seen = tp2[rank][arch]
        assert seen["kv_pool"] == (2, 4, 1, 64, BLOCK_SIZE, 32)
        assert seen["qkv"] == ((2 + 1 + 1) * 32, 128)
        assert seen["o_proj"] == (128, 2 * 32)


@pytest.mark.parametrize("rank", range(TP))
def test_shard_is_the_rank_slice_of_the_full_weights(rank, tp_model_dirs):
    """Loaded in-process (no collectives needed to load): rows/columns by rank."""
    model_dir = tp_model_dirs["llama_attention_bias"]
    full, part = load_model(model_dir), load_model(model_dir, tp=TensorParallel(rank, TP))
    f_attn, p_attn = full.layers[1].self_attn, part.layers[1].self_attn
    q, kv = f_attn.q_size, f_attn.kv_size  # full sizes

    def rows(n: int, off: int) -> slice:  # this rank's 1/TP of n rows starting at off
        return slice(off + rank * n // TP, off + (rank + 1) * n // TP)

    for param in ("weight", "bias"):
        want = torch.cat([getattr(f_attn.qkv_proj, param)[rows(q, 0)],
                          getattr(f_attn.qkv_proj, param)[rows(kv, q)],
                          getattr(f_attn.qkv_proj, param)[rows(kv, q + kv)]])
        assert torch.equal(getattr(p_attn.qkv_proj, param), want), param
    assert torch.equal(p_attn.o_proj.weight, f_attn.o_proj.weight[:, rows(q, 0)])
    assert torch.equal(p_attn.o_proj.bias, f_attn.o_proj.bias)  # replicated, added once
    f_mlp, p_mlp = full.layers[1].mlp, part.layers[1].mlp
    inter = f_mlp.intermediate_size
    assert torch.equal(p_mlp.gate_up_proj.weight, torch.cat(
        [f_mlp.gate_up_proj.weight[rows(inter, 0)], f_mlp.gate_up_proj.weight[rows(inter, inter)]]))
    assert torch.equal(p_mlp.down_proj.weight, f_mlp.down_proj.weight[:, rows(inter, 0)])
    assert torch.equal(part.lm_head.weight, full.lm_head.weight)


@pytest.mark.parametrize("rank", range(TP))
@pytest.mark.parametrize("shape", ZOO_MOE)
def test_expert_shard_is_the_rank_slice_of_every_expert(shape, rank, zoo_dirs):
    """Every rank holds every expert, each cut to its columns of the expert's
    intermediate size; the router is whole."""
    full, part = load_model(zoo_dirs[shape]), load_model(zoo_dirs[shape],
                                                         tp=TensorParallel(rank, TP))
    f_moe, p_moe = full.layers[0].mlp, part.layers[0].mlp
    inter = f_moe.intermediate_size
    cols = slice(rank * inter // TP, (rank + 1) * inter // TP)
    assert torch.equal(p_moe.gate_up, torch.cat([f_moe.gate_up[:, :inter][:, cols],
                                                 f_moe.gate_up[:, inter:][:, cols]], dim=1))
    assert torch.equal(p_moe.down, f_moe.down[:, :, cols])
    assert torch.equal(p_moe.gate.weight, f_moe.gate.weight)


@pytest.mark.parametrize("rank", range(TP))
def test_phi3_fused_tensors_shard_by_section(rank, zoo_dirs):
    """Phi-3 stores qkv_proj and gate_up_proj fused: each section (q, k, v;
    gate, up) is split across ranks, not the fused tensor's rows as a whole."""
    model_dir = zoo_dirs["phi3-longrope"]
    full, part = load_model(model_dir), load_model(model_dir, tp=TensorParallel(rank, TP))
    f_attn, p_attn = full.layers[0].self_attn, part.layers[0].self_attn
    q, kv = f_attn.q_size, f_attn.kv_size

    def rows(n: int, off: int) -> slice:
        return slice(off + rank * n // TP, off + (rank + 1) * n // TP)

    qkv = f_attn.qkv_proj.weight
    assert torch.equal(p_attn.qkv_proj.weight, torch.cat(
        [qkv[rows(q, 0)], qkv[rows(kv, q)], qkv[rows(kv, q + kv)]]))
    gate_up, inter = full.layers[0].mlp.gate_up_proj.weight, full.layers[0].mlp.intermediate_size
    assert torch.equal(part.layers[0].mlp.gate_up_proj.weight,
                       torch.cat([gate_up[rows(inter, 0)], gate_up[rows(inter, inter)]]))


def test_tp_that_does_not_divide_heads_is_refused(tiny_model):
    with pytest.raises(ValueError, match="tp=3"):
        load_model(tiny_model, tp=TensorParallel(0, 3))
    with pytest.raises(ValueError, match="tp=4 does not divide num_kv_heads=2"):
        load_model(tiny_model, tp=TensorParallel(0, 4))
    with pytest.raises(ValueError, match="tp=2"):
        TensorParallel(2, 2)


def test_kv_bytes_per_block_is_the_rank_share(tiny_model):
    cfg = load_model(tiny_model).config
    whole = cfg.kv_bytes_per_block(16)
    assert cfg.kv_bytes_per_block(16, tp_size=2) * 2 == whole
    with pytest.raises(ValueError, match="tp=3"):
        cfg.kv_bytes_per_block(16, tp_size=3)


def test_tp1_needs_no_process_group():
    tp = init_tensor_parallel(0, 1, "tcp://127.0.0.1:1")  # nothing listens there: unused
    x = torch.ones(3)
    assert not tp.is_parallel and tp.all_reduce(x) is x and torch.equal(x, torch.ones(3))
