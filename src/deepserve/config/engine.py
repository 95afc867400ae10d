"""EngineConfig: what one TE needs to run one model; a frozen dataclass,
validated at construction, read from an [engine] table (conf/engine.toml) or
from a node's [[te]] tables (config/node.py builds their schema from the
fields here, so the two never disagree). Fields left None are
derived from the model (`resolve`) before the engine starts; after that the
config never changes.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from deepserve.config.cluster import WILDCARD_HOSTS

QUANTIZE_MODES = ("", "int8", "int4", "gguf")  # "": the weights as they are
MAX_KV_LOAD_LAYERS = 64  # ring slots of a layered load (staging: that many layers)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Path of a Hugging Face model directory."""
    dtype: str | None = None
    """"float32" or "bfloat16"; None takes config.json's."""
    quantize: str = ""
    """"int8" / "int4": the projections' weights quantized at load (round to
    nearest, a scale per group of 32 inputs; model/quantize.py) for the int8
    kernels, which stream about 1.1 / 0.75 bytes a weight per decode step
    instead of bf16's 2; needs a bfloat16 model and the C++ kernels. "gguf": a
    model imported from a GGUF file runs its Q8_0 / Q4_0 / Q4_1 / Q4_K
    projections as the file quantized them (model/stored_quants.py), the
    others in bf16. "": the checkpoint's weights as they are (an AWQ / GPTQ /
    compressed-tensors checkpoint's quantized ones included, which refuse any
    other mode: model/checkpoint_quants.py)."""
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; None derives it from kv_cache_memory."""
    kv_cache_memory: int = 512 << 20
    """Bytes of KV pool, used when num_kv_blocks is None."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    max_num_seqs: int = 256
    """Running sequences at most."""
    light_step_tokens: int = 0
    """Token budget of a step while a light tenant may come (engine/scheduler.py:
    a tenant seen lately has nothing running while another has): its request
    waits for the step under way, so that step is kept short; 0: the full
    max_num_batched_tokens."""
    max_model_len: int | None = None
    """Prompt + output tokens at most; None: the model's max_position_embeddings
    (capped by what the KV pool holds)."""
    enable_prefix_caching: bool = True
    """Reuse KV of equal prompt prefixes through the radix tree."""
    seed: int = 0
    """Seed of the generator shared by unseeded sampled requests."""
    processes: bool = False
    """Run the TE as processes (master, tokenizer, one worker per device)
    instead of in the caller's process."""
    tp: int = 1
    """Tensor-parallel degree: worker processes sharing one model (processes only)."""
    async_scheduling: bool = True
    """Build step N+1 while step N runs (processes only); False: synchronous."""
    num_threads: int | None = None
    """torch threads per worker process; None: the machine's cores / tp, and in a
    node's TE its share of them (engine/te/te_server.py cores_share: the cores
    over the devices the node's TEs may take, times tp)."""
    startup_timeout_s: float = 120.0
    """Seconds the TE's processes have to load and report ready."""
    kv_transfer_backend: str = "shm"
    """How a prefill TE sends KV to a decode TE (DistFlow): "shm" straight into
    its shared-memory pool, "ring" through a staging ring, "tcp" over ZeroMQ.
    A TE whose peers send with ring/tcp starts a receiver for them."""
    kv_bind_host: str = "127.0.0.1"
    """The address a ring/tcp KV receiver and a layer-stream server bind: on a
    loopback address they listen on ipc:// paths in the TE's run directory
    (this host's TEs only, transfer/receiver.py kv_bind); a node of many hosts
    sets its [cluster] host here (tcp, CURVE with [cluster] secure)."""
    kv_transfer_layerwise: bool = False
    """Send each layer's KV as soon as that layer is computed (overlaps the
    transfer with the rest of the forward) instead of after the forward."""
    kv_transfer_timeout_s: float = 30.0
    """A prefill TE frees KV it sent when no acknowledgement comes in this
    time; a decode TE fails a request whose KV has not come in this time."""
    storage_read_gbps: float | None = None
    """GB/s this TE may read from the disk tier (the node's KV storage): a token
    bucket standing in for its storage NIC (DualPath); None: unlimited."""
    kv_load_layers: int = 0
    """Hits below the device: 0 loads them whole before the request queues;
    N (1..MAX_KV_LOAD_LAYERS, tp 1) loads disk hits layer by layer through a
    ring of N layers, the first N read before the request queues and the rest
    during its prefill, each just before its layer computes (DualPath's
    layer-wise prefill: worker/layer_loads.py)."""
    kv_stream_bytes: int = 0
    """Host memory a decode TE may hold as layer streams (DualPath's decode read
    path: the disk hits it reads for a prefill TE, which pulls them a layer at a
    time during its forward, over tcp: transfer/layer_stream.py); 0: none, and
    staged hits go through the node's host tier, which only prefill TEs of
    this host can read. The prefill TE needs kv_load_layers > 0 to pull them.
    A prefill TE's (with kv_load_layers > 0) is its PE buffer: a request
    waiting for room in its pool has its disk hits read ahead into it, and
    loads them from there in place once it has room."""
    dualpath_hop: str = "auto"
    """How a decode TE hands the hits it read to its prefill TE: "auto" streams
    them to a prefill TE on another host (with kv_stream_bytes) and stages them
    in the host tier for one on this host; "stream" streams them to every one."""
    timeline_dir: str | None = None
    """A folder where each of the TE's processes writes its step timeline (the
    parts of every step, timed) when it stops: tools/profile_step.py --engine
    reads it. None: no timeline is kept."""

    def __post_init__(self):
        for name in ("block_size", "kv_cache_memory", "max_num_batched_tokens", "max_num_seqs",
                     "tp"):
            _positive(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        v = self.light_step_tokens
        if isinstance(v, bool) or not isinstance(v, int) \
                or not 0 <= v <= self.max_num_batched_tokens:
            raise ValueError(f"light_step_tokens must be 0..max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}), got {self.light_step_tokens}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        if self.quantize and self.dtype not in (None, "bfloat16"):
            raise ValueError(f"quantize = {self.quantize!r} needs dtype bfloat16 (or unset, "
                             f"from a bf16 checkpoint), got {self.dtype!r}")
        if self.kv_transfer_backend not in ("shm", "ring", "tcp"):
            raise ValueError(f"kv_transfer_backend must be shm, ring or tcp, "
                             f"got {self.kv_transfer_backend!r}")
        if self.kv_bind_host in WILDCARD_HOSTS:
            raise ValueError(f"kv_bind_host must name this host's address, got "
                             f"{self.kv_bind_host!r}")
        if self.storage_read_gbps is not None and (
                isinstance(self.storage_read_gbps, bool) or not self.storage_read_gbps > 0):
            raise ValueError(f"storage_read_gbps must be > 0, got {self.storage_read_gbps!r}")
        if (isinstance(self.kv_load_layers, bool) or not isinstance(self.kv_load_layers, int)
                or not 0 <= self.kv_load_layers <= MAX_KV_LOAD_LAYERS):
            raise ValueError(f"kv_load_layers must be an integer in 0..{MAX_KV_LOAD_LAYERS}, "
                             f"got {self.kv_load_layers!r}")
        if self.kv_load_layers and self.tp != 1:
            raise ValueError("kv_load_layers needs tp = 1 (each layer is read whole)")
        if (isinstance(self.kv_stream_bytes, bool) or not isinstance(self.kv_stream_bytes, int)
                or self.kv_stream_bytes < 0):
            raise ValueError(f"kv_stream_bytes must be an integer >= 0, "
                             f"got {self.kv_stream_bytes!r}")
        if self.dualpath_hop not in ("auto", "stream"):
            raise ValueError(f"dualpath_hop must be auto or stream, got {self.dualpath_hop!r}")
        if self.dualpath_hop == "stream" and not self.kv_stream_bytes:
            raise ValueError("dualpath_hop = \"stream\" needs kv_stream_bytes > 0")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.tp > 1 and not self.processes:
            raise ValueError("tp > 1 needs processes=True (one worker process per rank)")

    @classmethod
    def from_options(cls, model: str, **options) -> "EngineConfig":
        """Build from keyword options; an unknown one is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=str(model), **options)

    def resolve(self, max_position_embeddings: int, kv_bytes_per_block: int) -> "EngineConfig":
        """Fill the derived fields from the model's numbers."""
        num_blocks = self.num_kv_blocks or max(1, self.kv_cache_memory // kv_bytes_per_block)
        max_len = min(self.max_model_len or max_position_embeddings, max_position_embeddings)
        if self.max_model_len is not None and max_len < self.max_model_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_position_embeddings}")
        pool_tokens = num_blocks * self.block_size
        if self.max_model_len is not None and pool_tokens < max_len:
            raise ValueError(f"num_kv_blocks {num_blocks} x block_size {self.block_size} cannot "
                             f"hold one sequence of max_model_len {max_len}")
        return replace(self, num_kv_blocks=num_blocks, max_model_len=min(max_len, pool_tokens))


def load_config(path: str | Path, overrides: dict | None = None) -> EngineConfig:
    """Read the [engine] table of a TOML file (unknown keys are errors);
    `overrides` (e.g. from the command line) win over the file."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    unknown = sorted(set(raw) - {"engine"})
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {unknown}; known: ['engine']")
    options = {**raw.get("engine", {}), **(overrides or {})}
    if "model" not in options:
        raise ValueError(f"{path}: [engine] needs model = \"PATH\"")
    model = Path(options.pop("model"))
    if not model.is_absolute():  # relative to the repository root, like conf/ itself
        model = Path(path).resolve().parent.parent / model
    try:
        return EngineConfig.from_options(str(model), **options)
    except (TypeError, ValueError) as e:  # the field's name leads the message
        raise ValueError(f"{path}: [engine] {e}") from None


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
