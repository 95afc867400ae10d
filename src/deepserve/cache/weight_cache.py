"""Node-level weight cache in shared memory (DeepServe's "DRAM pre-load").

    root/                         e.g. /dev/shm/deepserve-weights (tmpfs: RAM)
      .lock                       flock: one ensure() copies at a time
      <key>/                      one cached model: a copy of every regular
        config.json, *.safetensors, tokenizer files ...   top-level file
        .used                     its mtime is the entry's last use (LRU)
      <key>.tmp-<pid>-<rand>/     a copy in progress (never read)
      <key>.evict-<pid>-<rand>/   an entry being deleted

A key is `<dir name>-<sha1[:16]>` of the model directory's resolved path and
the names, sizes and mtimes (ns) of its files: the same content gives the
same key, a rewritten file gives a new one (the stale entry ages out by LRU).

ensure() copies a model in under `<key>.tmp-*` and publishes it with one
os.rename, so readers see a whole entry or none. It holds an flock on
root/.lock while it makes room and copies, so two processes warming the same
model copy it once; should a rename still lose a race, the loser drops its
copy. lookup() takes no lock: it is a stat and a touch.

Eviction renames an entry out of sight, then deletes it. A worker that has
already opened or mmap'd the files keeps reading them (Linux frees unlinked
files when the last mapping goes); one that looked up the entry but has not
yet opened it gets FileNotFoundError and should load from disk instead.
Pure Python and stdlib; workers find their weights with cached_model_dir().
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

ENV_VAR = "DEEPSERVE_WEIGHT_CACHE"
USED_FILE = ".used"
LOCK_FILE = ".lock"
# keys never contain a dot: a name with one is a copy or an eviction in progress


def model_files(model_dir: Path) -> list[Path]:
    """The regular top-level files of a model directory (symlinks followed), by name."""
    return sorted((f for f in model_dir.iterdir() if f.is_file()), key=lambda f: f.name)


def cache_key(model_dir: str | Path) -> str:
    """Stable for the same content: resolved path, file names, sizes and mtimes."""
    path = Path(model_dir).resolve()
    digest = hashlib.sha1(str(path).encode())
    for f in model_files(path):
        st = f.stat()
        digest.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    name = re.sub(r"[^A-Za-z0-9_-]", "_", path.name)[:40] or "model"
    return f"{name}-{digest.hexdigest()[:16]}"


class WeightCache:
    """Copies of model directories under `root`, at most budget_bytes of files."""

    def __init__(self, root: str | Path, budget_bytes: int):
        self.root = Path(root)
        self.budget_bytes = budget_bytes

    def key(self, model_dir: str | Path) -> str:
        return cache_key(model_dir)

    def lookup(self, model_dir: str | Path) -> Path | None:
        """The cached copy of model_dir, marked used now; None if not cached."""
        try:
            entry = self.root / self.key(model_dir)
            if not entry.is_dir():
                return None
            (entry / USED_FILE).touch()
        except OSError:  # no such model dir, or the entry was evicted just now
            return None
        return entry

    def ensure(self, model_dir: str | Path) -> Path | None:
        """The cached copy of model_dir, copied in if absent (evicting the least
        recently used entries to fit); None, copying nothing, when the model
        alone is larger than the budget. OSError (e.g. tmpfs full) propagates
        after the partial copy is removed."""
        src = Path(model_dir)
        files = model_files(src)
        size = sum(f.stat().st_size for f in files)
        if size > self.budget_bytes:
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            hit = self.lookup(src)
            if hit is not None:
                return hit
            self._sweep_leftovers()
            key = self.key(src)
            self._make_room(size, keep=key)
            return self._publish(self._copy(files, key), self.root / key)

    def entries(self) -> list[tuple[str, int, float]]:
        """(key, bytes, last used as a Unix time) of every entry, oldest use first."""
        found = []
        for entry in self._entry_dirs():
            try:
                used = entry / USED_FILE
                last = (used if used.exists() else entry).stat().st_mtime
                size = sum(f.stat().st_size for f in model_files(entry))
            except OSError:  # evicted while we looked
                continue
            found.append((entry.name, size, last))
        return sorted(found, key=lambda e: e[2])

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, key: str) -> bool:
        """Remove one entry (readers with open files keep them); False if absent."""
        entry = self.root / key
        if "." in key or not entry.is_dir():
            return False
        gone = self.root / f"{key}.evict-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry, gone)  # out of sight at once; the delete may take a while
        except FileNotFoundError:
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True

    def clear(self) -> None:
        """Remove the whole cache, root included."""
        shutil.rmtree(self.root, ignore_errors=True)

    # -- internals ---------------------------------------------------------------
    def _entry_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if "." not in p.name and p.is_dir()]

    def _make_room(self, size: int, keep: str) -> None:
        """Evict least recently used entries until `size` more bytes fit."""
        entries = [e for e in self.entries() if e[0] != keep]
        used = sum(e[1] for e in entries)
        for key, nbytes, _ in entries:
            if used + size <= self.budget_bytes:
                break
            if self.evict(key):
                used -= nbytes

    def _copy(self, files: list[Path], key: str) -> Path:
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-{os.getpid()}-", dir=self.root))
        try:
            for f in files:
                shutil.copyfile(f, tmp / f.name)
            (tmp / USED_FILE).touch()
            tmp.chmod(0o755)  # mkdtemp made it owner-only
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    def _publish(self, tmp: Path, entry: Path) -> Path:
        """Rename tmp to entry (atomic); if entry appeared meanwhile, drop tmp."""
        try:
            os.rename(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not entry.is_dir():
                raise
            with contextlib.suppress(OSError):
                os.utime(entry / USED_FILE)
        return entry

    def _sweep_leftovers(self) -> None:
        """Under the lock no copy is in progress: any `.tmp-` dir is a crashed
        copy's; `.evict-` dirs are deleted twice at worst (harmless)."""
        for path in self.root.iterdir():
            if path.is_dir() and (".tmp-" in path.name or ".evict-" in path.name):
                shutil.rmtree(path, ignore_errors=True)


def cached_model_dir(model_dir: str, root: str | None = None) -> tuple[str, str]:
    """(directory to load the weights from, "cache" or "disk"). The cache root
    is `root`, by default $DEEPSERVE_WEIGHT_CACHE; empty, or no entry: the
    model dir. Looks up only: it copies nothing."""
    root = os.environ.get(ENV_VAR, "") if root is None else root
    if root:
        hit = WeightCache(root, budget_bytes=0).lookup(model_dir)
        if hit is not None:
            return str(hit), "cache"
    return str(model_dir), "disk"
