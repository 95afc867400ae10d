"""A checkpoint's quantization_config (config.json), checked without torch:
the methods model/checkpoint_quants.py reads, and a ModelLoadError naming
any method, bit width or option it does not."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepserve.errors import ModelLoadError


@dataclass(frozen=True)
class QuantMethod:
    """A checkpoint's quantization, as far as the loader needs it."""

    name: str
    """"awq", "gptq" or "compressed-tensors"."""
    zero_offset: int = 0
    """Added to stored zero points (GPTQ's "gptq" format: 1)."""


def quant_method(config: object, path: Path) -> QuantMethod:
    """config.json's quantization_config -> its method; ModelLoadError naming
    what we do not read."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: quantization_config must be an object")
    name = config.get("quant_method", "?")
    if name == "awq":
        _need(config, path, bits=4, version="gemm", zero_point=True)
        return QuantMethod("awq")
    if name == "gptq":
        _need(config, path, bits=4)
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"{path}: GPTQ checkpoint_format {fmt!r} is not supported")
        return QuantMethod("gptq", zero_offset=1 if fmt == "gptq" else 0)
    if name == "compressed-tensors":
        _check_compressed(config, path)
        return QuantMethod("compressed-tensors")
    raise ModelLoadError(f"{path}: quantization_config (quant_method {name!r}) is not "
                         "supported; supported: awq and gptq (4-bit), compressed-tensors "
                         "(int8 weights); or load a bf16 checkpoint (quantize = \"int8\" "
                         "quantizes one at load)")


DEFAULTS = {"version": "gemm", "zero_point": True}
"""What AutoAWQ and transformers' AwqConfig mean when a key is left out."""


def _need(config: dict, path: Path, **wanted) -> None:
    method = config.get("quant_method")
    for key, value in wanted.items():
        got = config.get(key, DEFAULTS.get(key))
        if isinstance(got, str) and isinstance(value, str):
            got = got.lower()
        if got != value:
            raise ModelLoadError(f"{path}: {method} with {key} = {got!r} is not supported "
                                 f"(only {key} = {value!r})")


def _check_compressed(config: dict, path: Path) -> None:
    fmt = config.get("format")
    if fmt not in ("int-quantized", "naive-quantized"):
        raise ModelLoadError(f"{path}: compressed-tensors format {fmt!r} is not supported "
                             "(only int-quantized int8 weights)")
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type", "int") != "int" or \
                not weights.get("symmetric", True):
            raise ModelLoadError(f"{path}: compressed-tensors weights {weights} are not "
                                 "supported (only 8-bit symmetric int)")
        if weights.get("strategy") not in ("channel", "tensor", "group"):
            raise ModelLoadError(f"{path}: compressed-tensors strategy "
                                 f"{weights.get('strategy')!r} is not supported")
