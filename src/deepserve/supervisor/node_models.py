"""The models a node holds: declared in its config, learned from the head's
ScaleOuts, forked from peers; where their files are, and who may have them.

    declared  [node] model, [[model]]          their directories, as configured
    learned   a ScaleOut's path and options    a joined node serves a head's [[model]]
                                               from that path when it exists here,
    forked                                     else from a copy pulled from a peer
                                               (fork(): cache/weight_fork.py) into
                                               /dev/shm/deepserve-f<run id>/
    weight cache (cache/weight_cache.py)       filled in the background as models
                                               are declared or learned
    weight server (fork's other end)           shares every directory held here
                                               with peers, keyed by the head's path,
                                               and relays a fork under way (a chain)

The node owns one NodeModels; the scaler asks it through the node (learn,
holds, fork) and the node's report lists what it caches and serves.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import threading
import time
from pathlib import Path

import zmq

from deepserve.cache.weight_cache import WeightCache
from deepserve.cache.weight_fork import Forked, Partial, WeightServer, fork_model
from deepserve.config.models import ModelSpec

log = logging.getLogger(__name__)


def has_model(directory: str | Path) -> bool:
    return (Path(directory) / "config.json").is_file()


class NodeModels:
    """config: the node's; weights: its weight cache (None: none); forked_root:
    where forks land (removed by stop())."""

    def __init__(self, config, weights: WeightCache | None, forked_root: Path):
        self.config, self.weights, self.forked_root = config, weights, forked_root
        self.learned: dict[str, ModelSpec] = {}  # name -> spec (path: where it is read here)
        self.forked: dict[str, Path] = {}  # the head's path -> the forked copy here
        self.partials: dict[str, Partial] = {}  # forks under way (relayed by the server)
        self.server: WeightServer | None = None
        self._lock = threading.Lock()  # learned / forked: the weight server's thread reads them
        self._stopping = threading.Event()
        self._fillers: list[threading.Thread] = []

    # -- which model, from where --------------------------------------------------------
    def spec(self, name: str, path: str = "", options: dict | None = None
             ) -> tuple[ModelSpec | None, bool]:
        """(the spec of model `name`, whether it was learned just now): declared,
        learned before, or learned now from a ScaleOut's path and options when
        its files are here (that path, or a fork of it); (None, False): unknown,
        not here, or a spec its engine options refuse."""
        try:
            return self.config.model_spec(name), False
        except KeyError:
            pass
        if name in self.learned or not path:
            return self.learned.get(name), False
        local = path if has_model(path) else self.forked.get(path)
        if local is None:
            return None, False
        spec = ModelSpec(name=name, path=str(local), options=dict(options or {}))
        try:
            spec.check()
        except (ValueError, TypeError) as e:
            log.error("model %s from the head refused: %s", name, e)
            return None, False
        with self._lock:
            self.learned[name] = spec
        self.fill_in_background([spec])
        return spec, True

    def holds(self, path: str) -> bool:
        """Model `path`'s files are here (its directory, or a fork of it)."""
        return has_model(path) or path in self.forked

    def fork(self, path: str, sources: list[str]) -> Forked:
        """Pull model `path` from the first source that gives it (ForkError: none).
        Its own ZeroMQ context: a node that stops never waits on a fork's socket."""
        digest = hashlib.sha1(path.encode()).hexdigest()[:12]
        name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(path).name)[:40] or "model"
        ctx, partial = zmq.Context(), Partial()
        with self._lock:
            self.partials[path] = partial
        try:
            forked = fork_model(ctx, sources, path, self.forked_root / f"{name}-{digest}",
                                partial=partial)
            with self._lock:
                self.forked[path] = self.forked_root / f"{name}-{digest}"
        finally:
            with self._lock:
                self.partials.pop(path, None)
            ctx.term()
        return forked

    def drop_fork(self, path: str) -> None:
        """Forget model `path`'s fork and remove its copy (a later order forks again)."""
        with self._lock:
            copy = self.forked.pop(path, None)
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)

    def under_way(self) -> dict[str, Partial]:
        """Forks under way, for the weight server to relay."""
        with self._lock:
            return dict(self.partials)

    # -- what the node tells the head ---------------------------------------------------
    def served(self) -> dict[str, Path]:
        """Model path (the head's name for it) -> the directory holding its files
        here, in the weight cache's copy (memory) when it has one."""
        with self._lock:
            models, forked = self._all(), dict(self.forked)
        dirs = {m.path: self._cached_copy(m.path) or Path(m.path)
                for m in models if has_model(m.path)}
        dirs.update(forked)
        return dirs

    def holdings(self) -> tuple[list[str], list[str]]:
        """(the model directories the weight cache holds, all those held here):
        the node's report, from one scan."""
        served = self.served()
        root = self.weights.root if self.weights is not None else None
        return sorted(p for p, d in served.items() if d.parent == root), sorted(served)

    def _cached_copy(self, path: str) -> Path | None:
        if self.weights is None:
            return None
        try:
            entry = self.weights.root / self.weights.key(path)
            return entry if entry.is_dir() else None
        except OSError:  # the directory went meanwhile
            return None

    def _all(self) -> list[ModelSpec]:
        return list(self.config.all_models) + list(self.learned.values())

    # -- background work ----------------------------------------------------------------
    def start_server(self, ctx: zmq.Context, address: str) -> None:
        """Share what is held here with peers that fork it ([cluster] port+5)."""
        self.server = WeightServer(ctx, address, self.served, self.under_way)

    def fill_in_background(self, models) -> None:
        if self.weights is not None:
            filler = threading.Thread(target=self._fill_weight_cache, args=(list(models),),
                                      name="weight-cache", daemon=True)
            self._fillers.append(filler)
            filler.start()

    def _fill_weight_cache(self, models: list[ModelSpec]) -> None:
        """DRAM pre-load: the models' weights into the node's cache (those that
        may scale from zero first, the fixed [[te]] one last: its TEs only need
        it to restart), within its budget (LRU)."""
        models = sorted(models, key=lambda m: (
            not m.scalable, m.min_tes > 0 and m.idle_s is None, m.name))
        for model in models:
            if self._stopping.is_set():
                return
            try:
                started = time.monotonic()
                if self.weights.ensure(model.path) is not None:
                    log.warning("weight cache: %s in %.2f s", model.name,
                                time.monotonic() - started)
            except OSError as e:  # shared memory full, model gone: TEs load from disk
                log.error("weight cache: %s not cached: %s", model.name, e)

    def stop(self) -> None:
        """The server and the fillers stopped; the weight cache and the forks removed."""
        if self.server is not None:
            self.server.stop()
        self._stopping.set()
        for filler in self._fillers:
            filler.join(30)  # a copy in progress: then nothing recreates the root
        if self.weights is not None:
            self.weights.clear()
        shutil.rmtree(self.forked_root, ignore_errors=True)
