"""What the node holds over a chaos run: RSS and open fds of every process,
its shared memory, its disk tier; and how much that grew.

    ResourceSampler (a thread) ──every interval_s──> sample():
        psutil: the node's root pid + every descendant, grouped by component
                (the node's process table names the nearest ancestor: te0,
                pool0, gateway, job-executor, kv-cache, ...; else its --te-id /
                --role; the root: "node")
        /dev/shm: segments whose names start with the run's prefixes (st_blocks: real use)
        disk tier: bytes of files under [node] disk_cache_dir, if set
    growth(samples, after_s) ──> per component: its last minus its first sample at/after
                                 after_s in its usual shape (process count)

The root is the process that runs the node: bin/deepserve-chaos itself (the
node's supervisor is a thread of it, drill-style), so "node" includes the
load's client too; the other components are the node's own children.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from deepserve.ipc.segments import SHM_DIR

ROOT_LABEL = "node"
_LABEL_FLAGS = ("--te-id", "--role")


@dataclass
class Sample:
    t: float
    """Seconds since the run started."""
    rss_bytes: int
    num_fds: int
    num_procs: int
    shm_bytes: int
    disk_bytes: int
    by_component: dict[str, list[int]] = field(default_factory=dict)
    """component -> [rss bytes, fds, processes]."""

    def to_dict(self) -> dict:
        return asdict(self)


def component_of(proc: psutil.Process, root_pid: int,
                 names: dict[int, str] | None = None) -> str:
    """The component a process belongs to: the name `names` (pid -> name:
    the node's process table, where an adopted pod has its TE's name) gives
    it or its nearest ancestor, else their --te-id / --role; the root itself
    is ROOT_LABEL."""
    p: psutil.Process | None = proc
    while p is not None and p.pid != root_pid:
        if names and p.pid in names:
            return names[p.pid]
        try:
            argv = p.cmdline()
        except psutil.Error:
            argv = []
        for flag in _LABEL_FLAGS:
            if flag in argv[:-1]:
                return argv[argv.index(flag) + 1]
        try:
            p = p.parent()
        except psutil.Error:
            p = None
    return ROOT_LABEL


def tree_usage(root_pid: int, names: dict[int, str] | None = None) -> dict[str, list[int]]:
    """component -> [rss bytes, open fds, processes] over the root and its descendants."""
    out: dict[str, list[int]] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            rss, fds = proc.memory_info().rss, proc.num_fds()
            label = component_of(proc, root_pid, names)
        except psutil.Error:  # gone or a zombie since the listing
            continue
        entry = out.setdefault(label, [0, 0, 0])
        entry[0] += rss
        entry[1] += fds
        entry[2] += 1
    return out


def shm_bytes(prefixes: list[str], shm_dir: str = SHM_DIR) -> int:
    """Bytes in use by the segments whose names start with one of `prefixes`."""
    total = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        if any(name.startswith(p) for p in prefixes):
            total += _used(Path(shm_dir) / name)
    return total


def shm_names(prefixes: list[str], shm_dir: str = SHM_DIR) -> list[str]:
    try:
        return sorted(n for n in os.listdir(shm_dir) if any(n.startswith(p) for p in prefixes))
    except OSError:
        return []


def dir_bytes(path: str | os.PathLike | None) -> int:
    """Bytes in use by the files under `path` (0 when unset or missing)."""
    if not path:
        return 0
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            total += _used(Path(dirpath) / name)
    return total


def _used(path: Path) -> int:
    try:
        st = path.lstat()
    except OSError:
        return 0
    if path.is_dir():
        return dir_bytes(path)
    return st.st_blocks * 512


def growth(samples: list[Sample], after_s: float) -> dict:
    """From the first sample taken at or after `after_s` to the last: shm and
    disk (totals); per component, rss and fds from its first to its last
    sample *in its usual shape* (the process count it shows most often), so
    a TE caught mid-restart (its host alone, or a pod not yet adopted) is not
    read as memory freed or leaked; rss / fds totals are the components' sums.
    Only long-lived components count (in at least half of those samples):
    a scaled model's TEs and pre-warmed pods come and go under new names,
    and each one's start-to-loaded rise is no growth (seen: +4.2 GiB summed
    over 48 scale-outs and the pods of a 60-minute run, every TE flat).
    Empty when no sample is that late."""
    later = [s for s in samples if s.t >= after_s]
    if not later:
        return {}
    first, last = later[0], later[-1]
    by_component = {}
    for comp in sorted({c for s in later for c in s.by_component}):
        seen = [s.by_component[comp] for s in later if comp in s.by_component]
        if 2 * len(seen) < len(later):
            continue  # transient
        counts = Counter(v[2] for v in seen)
        usual = max(counts, key=lambda n: (counts[n], n))
        shaped = [v for v in seen if v[2] == usual]
        by_component[comp] = {"rss_bytes": shaped[-1][0] - shaped[0][0],
                              "num_fds": shaped[-1][1] - shaped[0][1]}
    return {"from_s": first.t, "to_s": last.t,
            "rss_bytes": sum(g["rss_bytes"] for g in by_component.values()),
            "num_fds": sum(g["num_fds"] for g in by_component.values()),
            "shm_bytes": last.shm_bytes - first.shm_bytes,
            "disk_bytes": last.disk_bytes - first.disk_bytes,
            "by_component": by_component}


def growth_after_s(duration_s: float) -> float:
    """When growth starts to count: after the first 10 minutes, or the first
    third of a shorter run."""
    return min(600.0, duration_s / 3)


class ResourceSampler:
    """Samples every interval_s in a thread until stop(); samples() is a copy."""

    def __init__(self, root_pid: int, shm_prefixes: list[str], disk_dir: str | None,
                 start: float, interval_s: float = 10.0, names=None):
        """names(): pid -> component name (the node's process table), or None."""
        self.root_pid, self.shm_prefixes, self.disk_dir = root_pid, shm_prefixes, disk_dir
        self.names = names
        self.start, self.interval_s = start, interval_s
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-resources", daemon=True)

    def sample(self) -> Sample:
        comps = tree_usage(self.root_pid, self.names() if self.names else None)
        s = Sample(t=round(time.time() - self.start, 3),
                   rss_bytes=sum(c[0] for c in comps.values()),
                   num_fds=sum(c[1] for c in comps.values()),
                   num_procs=sum(c[2] for c in comps.values()),
                   shm_bytes=shm_bytes(self.shm_prefixes), disk_bytes=dir_bytes(self.disk_dir),
                   by_component=comps)
        with self._lock:
            self._samples.append(s)
        return s

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def begin(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval_s + 30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a bad sample must not end the run
                pass
            self._stop.wait(self.interval_s)
