"""Tensor parallelism: two gloo ranks in spawned processes sample what tp=1 samples.

One pair of child processes serves every architecture (process start-up and
`import torch` dominate the cost); the parent runs the same greedy steps at
tp=1 and compares token ids. A child's exception comes back through the queue
with its traceback; a hung or crashed child fails the test instead of hanging it.
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
from deepserve.model.parallel import (TensorParallel, destroy_tensor_parallel,
                                      init_tensor_parallel)
from deepserve.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow  # starts process trees

TP = 2
PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], [1200, 3, 64, 64, 811, 2, 19, 450, 31, 8, 600],
           [900, 14, 250]]
NUM_DECODE_STEPS = 10
BLOCK_SIZE = 4  # small, so every sequence spans several blocks
BLOCKS_PER_SEQ = 8  # covers 11 + 10 tokens
CHILD_TIMEOUT_S = 60


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


def _rank_main(rank: int, port: int, model_dirs: dict[str, str], results: mp.Queue) -> None:
    """One tp rank (child process): load each model's shard, run the steps, report."""
    try:
        torch.set_num_threads(1)
        tp = init_tensor_parallel(rank, TP, f"tcp://127.0.0.1:{port}", timeout_s=30)
        out = {}
        for arch, model_dir in model_dirs.items():
            runner = ModelRunner(load_model(model_dir, tp=tp), num_blocks=64,
                                 block_size=BLOCK_SIZE)
            attn = runner.model.layers[0].self_attn
            out[arch] = {"tokens": _greedy_run(runner), "kv_pool": tuple(runner.kv_pool.shape),
                         "qkv": tuple(attn.qkv_proj.weight.shape),
                         "o_proj": tuple(attn.o_proj.weight.shape)}
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
def tp_model_dirs(model_dirs, tmp_path_factory) -> dict[str, str]:
    biased = _with_attention_bias(model_dirs["llama"], tmp_path_factory.mktemp("tp") / "llama")
    return {"llama": str(model_dirs["llama"]), "qwen2": str(model_dirs["qwen2"]),
            "llama_attention_bias": str(biased)}


@pytest.fixture(scope="module")
def tp2(tp_model_dirs) -> dict | str:
    """rank -> arch -> what that rank saw; or the failure, reported by each test."""
    return _run_ranks(tp_model_dirs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_attention_bias"])
def test_tp2_samples_the_same_tokens_as_tp1(arch, tp_model_dirs, tp2):
    if isinstance(tp2, str):
        pytest.fail(tp2, pytrace=False)
    torch.manual_seed(0)
    expected = _greedy_run(ModelRunner(load_model(tp_model_dirs[arch]), 64, BLOCK_SIZE))
    assert tp2[0][arch]["tokens"] == expected
    assert tp2[1][arch]["tokens"] == expected  # SPMD: every rank samples the same


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
