"""The node's GGUF models, imported before any TE starts: every model path
of the config ([node] model, [[model]] path, --model) that names a .gguf
file is replaced by its Hugging Face directory under [node] gguf_cache_dir,
so TEs, the weight cache, forks and pre-warmed pods only see directories.

The import runs as a command (`python -m deepserve.model.gguf FILE --cache
DIR`), not an import: the supervisor does not import the model room, and
the converter's torch stays out of the node's process. A cached file costs
that command's hash of the file (~0.3 s for the built-in model).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from msgspec.structs import replace

from deepserve.config.models import is_gguf
from deepserve.config.node import NodeConfig
from deepserve.errors import ModelLoadError

log = logging.getLogger(__name__)
IMPORT_TIMEOUT_S = 3600.0
"""A 70 B model's dequantization takes minutes; this only bounds a stuck one."""


def import_node_models(config: NodeConfig) -> NodeConfig:
    """config with each .gguf model path replaced by its imported directory
    (served names stay what the file's name gave); ModelLoadError naming the
    file when one cannot be imported."""
    files = [config.node.model, *(m.path for m in config.models)]
    done = {path: import_file(path, config.node.gguf_cache_dir)
            for path in dict.fromkeys(files) if path and is_gguf(path)}
    if not done:
        return config
    node = replace(config.node, model=done.get(config.node.model, config.node.model))
    models = tuple(replace(m, path=done.get(m.path, m.path)) for m in config.models)
    return replace(config, node=node, models=models)


def import_file(path: str, cache_dir: str) -> str:
    """The directory of one GGUF file, imported now or found in the cache."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "deepserve.model.gguf", path,
                               "--cache", cache_dir], capture_output=True, text=True,
                              timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"{path}: GGUF import still running after "
                             f"{IMPORT_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise ModelLoadError(f"{path}: GGUF import failed: {why[0].removeprefix('Error: ')}")
    directory = done.stdout.strip().splitlines()[-1]
    log.info("node: model %s is %s (%.1f s)", path, directory, time.monotonic() - started)
    return directory
