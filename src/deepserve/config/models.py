"""Many models on one node: the [[model]] tables, [scaling], and ModelSpec.

    [[model]]   ModelSection    one deployable model: path, TE bounds, SLO, idle_s,
                                and any EngineConfig option for its TEs
    [scaling]   ScalingSection  the pre-warmed pool, the weight cache, the request
                                queue of a model with no TE, the autoscaler's knobs
    (resolved)  ModelSpec       one model as every process sees it

A model's TEs are not written in TOML: the autoscaler (control/cm/autoscaler.py,
in the cluster manager) keeps between `min_tes` and `max_tes` of them while
the model is active, and none once no request came for `idle_s` seconds; a
request for a model at zero is held (at most `queue_timeout_s`) while one
starts. The [node] model with its [[te]] tables is the one exception: its
TEs are fixed (static), unless the command line makes it scalable
(`--model`, `--scale-to-zero-after`: supervisor/__main__.py).
"""

from __future__ import annotations

import re
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from deepserve.config.engine import EngineConfig

_Section = msgspec.Struct
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
DEFAULT_MAX_TES = 2
"""max_tes of a model given on the command line."""


class SLOSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model's service-level objective, an inline table: { ttft_ms = 2000, tpot_ms = 200 }."""

    ttft_ms: Positive | None = None
    """Time to first token (ms) a request should meet; None: no TTFT objective."""
    tpot_ms: Positive | None = None
    """Time per output token (ms) a request should meet; None: no TPOT objective."""
    percentile: Annotated[float, Meta(gt=0, le=1)] = 0.9
    """Fraction of requests that must meet it (the autoscaler scales out below it)."""


class ScalingSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pool_size: Annotated[int, Meta(ge=0, le=64)] = 0
    """Pre-warmed TE processes kept ready (imports done, no model); 0: every TE starts
    cold (the schema's default, for embedded nodes; conf/node.toml keeps one)."""
    weight_cache_bytes: Annotated[int, Meta(ge=0)] = 1 << 30
    """Bytes of model weights the node keeps in shared memory (LRU); 0: no weight cache."""
    queue_timeout_s: Positive = 60.0
    """Seconds a request for a model with no TE waits for one to start; past it: 503."""
    window_s: Positive = 10.0
    """Seconds over which SLO attainment is measured."""
    out_queue_per_te: Positive = 2.0
    """Mean waiting requests per TE above which a model scales out."""
    in_load_per_te: Positive = 0.5
    """Mean requests (waiting + running) per remaining TE below which it may scale in."""
    out_cooldown_s: NonNegative = 3.0
    """Seconds between two load or SLO scale-outs of a model."""
    in_cooldown_s: NonNegative = 15.0
    """Seconds after any scale event of a model before it scales in."""
    in_sustain_s: NonNegative = 10.0
    """Seconds the load must stay low before a scale-in (hysteresis)."""


_ENGINE_HINTS = typing.get_type_hints(EngineConfig)
ModelSection = msgspec.defstruct(
    "ModelSection",
    [("path", str), ("name", str, ""),
     ("min_tes", Annotated[int, Meta(ge=0, le=64)], 1),
     ("max_tes", Annotated[int, Meta(ge=1, le=64)], DEFAULT_MAX_TES),
     ("idle_s", Positive | None, None), ("slo", SLOSection, SLOSection())]
    + [(f.name, _ENGINE_HINTS[f.name], f.default) for f in fields(EngineConfig)
       if f.name != "model" and f.default is not MISSING],
    kw_only=True, frozen=True, forbid_unknown_fields=True, module=__name__)
ModelSection.__doc__ = """One [[model]] table: `path` (a Hugging Face model
directory), `name` (what clients put in `model`; default: the directory's
name), `min_tes` (0 allowed) and `max_tes`, `idle_s` (to zero after this long
idle; unset: never), `slo`, and any EngineConfig option of its TEs."""


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One deployable model, resolved (path absolute)."""

    name: str
    path: str
    options: dict = {}
    """EngineConfig options of its TEs."""
    min_tes: int = 1
    max_tes: int = DEFAULT_MAX_TES
    idle_s: float | None = None
    slo: SLOSection = SLOSection()
    scalable: bool = True
    """False: the [node] model served by fixed [[te]] TEs (the autoscaler leaves it)."""

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_options(self.path, **{**self.options, "processes": True})

    @property
    def slug(self) -> str:
        """What its TE ids start with: short, safe in socket and shared-memory names."""
        return re.sub(r"[^A-Za-z0-9]", "", self.name)[:10] or "m"

    def te_id(self, n: int, node: str = "") -> str:
        """The id of the model's n-th TE (0, 1, ...: never reused in a run) on the
        node; a joined node's carry its [cluster] name (h1-tiny-0): ids are cluster-wide."""
        return f"{node}-{self.slug}-{n}" if node else f"{self.slug}-{n}"

    def check(self) -> None:
        if not self.name:
            raise ValueError("model: a model needs a name")
        if self.min_tes > self.max_tes:
            raise ValueError(f"model: {self.name!r}: min_tes {self.min_tes} > "
                             f"max_tes {self.max_tes}")
        self.engine_config()


def model_spec(section, options: dict) -> ModelSpec:
    """A [[model]] table (decoded) and the engine options it set -> ModelSpec."""
    return ModelSpec(name=section.name or model_name(section.path), path=section.path,
                     options=options, min_tes=section.min_tes, max_tes=section.max_tes,
                     idle_s=section.idle_s, slo=section.slo)


def parse_model_arg(value: str) -> tuple[str, str]:
    """`--model DIR` or `--model NAME=DIR` -> (name, dir)."""
    name, sep, path = value.partition("=")
    if not sep:
        name, path = "", value
    path = str(Path(path).resolve())
    return (name or model_name(path)), path


def is_gguf(path: str | Path) -> bool:
    """A model given as a GGUF file (imported into a directory before use:
    deepserve/model/gguf) rather than a Hugging Face directory."""
    return str(path).lower().endswith(".gguf")


def model_name(path: str | Path) -> str:
    """The name a model is served under by default: its directory's name, or
    a GGUF file's name without `.gguf`."""
    name = Path(path).name
    return name[:-len(".gguf")] if is_gguf(name) else name
