"""WeightCache: copy in, hit, keys that follow the content, atomic publish,
LRU eviction within the budget, and the workers' cached_model_dir()."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

from deepserve.cache.weight_cache import ENV_VAR, WeightCache, cached_model_dir


def _fake_model(path: Path, weight_bytes: int = 100) -> Path:
    """A model dir of known size: weight_bytes + 10 bytes of config, and a
    subdirectory the cache must not copy."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(weight_bytes))
    (path / "config.json").write_text("{}" + " " * 8)
    (path / "extra").mkdir()
    (path / "extra" / "ignored.bin").write_bytes(b"x" * 1000)
    return path


def _set_last_used(entry: Path, seconds_ago: float) -> None:
    """Pin an entry's last use (mtime granularity must not decide LRU order)."""
    t = time.time() - seconds_ago
    os.utime(entry / ".used", (t, t))


def _in_progress(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if ".tmp-" in p.name or ".evict-" in p.name]


def test_ensure_copies_once_then_hits(tmp_path):
    model = _fake_model(tmp_path / "m")
    cache = WeightCache(tmp_path / "cache", budget_bytes=1000)
    assert cache.lookup(model) is None
    entry = cache.ensure(model)
    assert entry == tmp_path / "cache" / cache.key(model)
    assert sorted(p.name for p in entry.iterdir()) == [".used", "config.json",
                                                        "model.safetensors"]
    assert (entry / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert cache.ensure(model) == entry and cache.lookup(model) == entry
    assert [(k, n) for k, n, _ in cache.entries()] == [(entry.name, 110)]
    assert cache.used_bytes() == 110
    assert _in_progress(cache.root) == []


def test_key_follows_path_names_sizes_and_mtimes(tmp_path):
    model = _fake_model(tmp_path / "m")
    cache = WeightCache(tmp_path / "cache", budget_bytes=1000)
    key = cache.key(model)
    assert cache.key(str(model)) == key and cache.key(tmp_path / "." / "m") == key
    assert "." not in key and key.startswith("m-")
    cache.ensure(model)

    st = (model / "config.json").stat()  # same size, new mtime: a new key
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert cache.key(model) != key
    assert cache.lookup(model) is None
    mtime_key = cache.key(model)
    (model / "model.safetensors").write_bytes(b"y" * 50)  # new size
    assert cache.key(model) not in (key, mtime_key)
    (model / "tokenizer.json").write_text("{}")  # new file
    assert cache.key(model) != mtime_key
    assert cache.key(_fake_model(tmp_path / "other")) != cache.key(model)


def test_two_threads_ensuring_one_model_make_one_entry(tmp_path):
    model = _fake_model(tmp_path / "m", weight_bytes=200_000)
    root = tmp_path / "cache"
    barrier, results = threading.Barrier(4), []

    def ensure() -> None:
        barrier.wait()
        results.append(WeightCache(root, budget_bytes=10**6).ensure(model))

    threads = [threading.Thread(target=ensure) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and len(set(results)) == 1
    assert len(WeightCache(root, 10**6).entries()) == 1
    assert _in_progress(root) == []


def _ensure_in_child(root: str, model: str) -> str:
    return str(WeightCache(root, budget_bytes=10**6).ensure(model))


def test_two_processes_ensuring_one_model_make_one_entry(tmp_path):
    model = _fake_model(tmp_path / "m", weight_bytes=200_000)
    root = tmp_path / "cache"
    with mp.get_context("spawn").Pool(2) as pool:
        got = pool.starmap(_ensure_in_child, [(str(root), str(model))] * 2)
    assert len(set(got)) == 1 and Path(got[0]).is_dir()
    assert len(WeightCache(root, 10**6).entries()) == 1
    assert _in_progress(root) == []


def test_a_copy_that_loses_the_rename_race_is_discarded(tmp_path, monkeypatch):
    model = _fake_model(tmp_path / "m")
    cache = WeightCache(tmp_path / "cache", budget_bytes=1000)
    entry = cache.ensure(model)
    (entry / "config.json").write_text("the winner's copy")
    monkeypatch.setattr(cache, "lookup", lambda model_dir: None)  # as if not there yet
    assert cache.ensure(model) == entry  # copied again, lost the rename
    assert (entry / "config.json").read_text() == "the winner's copy"
    assert _in_progress(cache.root) == []


def test_a_crashed_copy_is_swept_by_the_next_ensure(tmp_path):
    cache = WeightCache(tmp_path / "cache", budget_bytes=1000)
    crashed = cache.root / "m-0123456789abcdef.tmp-999999-xyz"
    crashed.mkdir(parents=True)
    (crashed / "model.safetensors").write_bytes(b"half")
    assert cache.entries() == []  # never an entry
    cache.ensure(_fake_model(tmp_path / "m"))
    assert not crashed.exists()


def test_lru_eviction_keeps_the_cache_within_budget(tmp_path):
    cache = WeightCache(tmp_path / "cache", budget_bytes=250)  # two 110-byte models fit
    a, b, c = (_fake_model(tmp_path / name) for name in "abc")
    _set_last_used(cache.ensure(a), 100)
    _set_last_used(cache.ensure(b), 50)
    cache.ensure(c)
    assert cache.lookup(a) is None  # least recently used: evicted
    assert cache.lookup(b) is not None and cache.lookup(c) is not None
    assert cache.used_bytes() == 220 <= cache.budget_bytes
    assert _in_progress(cache.root) == []


def test_lookup_marks_an_entry_used(tmp_path):
    cache = WeightCache(tmp_path / "cache", budget_bytes=250)
    a, b, c = (_fake_model(tmp_path / name) for name in "abc")
    _set_last_used(cache.ensure(a), 100)
    _set_last_used(cache.ensure(b), 50)
    assert cache.lookup(a) is not None  # a is now the most recently used
    assert [k for k, _, _ in cache.entries()] == [cache.key(b), cache.key(a)]
    cache.ensure(c)
    assert cache.lookup(b) is None
    assert cache.lookup(a) is not None and cache.lookup(c) is not None


def test_a_model_larger_than_the_budget_is_not_copied(tmp_path):
    cache = WeightCache(tmp_path / "cache", budget_bytes=250)
    small = cache.ensure(_fake_model(tmp_path / "small"))
    assert cache.ensure(_fake_model(tmp_path / "big", weight_bytes=300)) is None
    assert [k for k, _, _ in cache.entries()] == [small.name]  # nothing evicted for it


def test_evict_and_clear(tmp_path):
    cache = WeightCache(tmp_path / "cache", budget_bytes=1000)
    model = _fake_model(tmp_path / "m")
    entry = cache.ensure(model)
    with open(entry / "model.safetensors", "rb") as held:  # a reader keeps its file
        assert cache.evict(entry.name)
        assert len(held.read()) == 100
    assert not entry.exists() and cache.lookup(model) is None
    assert not cache.evict(entry.name) and not cache.evict("..")
    assert _in_progress(cache.root) == []
    cache.ensure(model)
    cache.clear()
    assert not cache.root.exists() and cache.entries() == [] and cache.used_bytes() == 0


def test_lookup_of_a_missing_model_or_root_is_a_miss(tmp_path):
    assert WeightCache(tmp_path / "none", 1000).lookup(tmp_path / "no-model") is None
    assert WeightCache(tmp_path / "none", 1000).lookup(_fake_model(tmp_path / "m")) is None


def test_cached_model_dir_reads_the_env_var(tmp_path, monkeypatch):
    model = _fake_model(tmp_path / "m")
    root = tmp_path / "cache"
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert cached_model_dir(str(model)) == (str(model), "disk")
    monkeypatch.setenv(ENV_VAR, "")
    assert cached_model_dir(str(model)) == (str(model), "disk")
    monkeypatch.setenv(ENV_VAR, str(root))
    assert cached_model_dir(str(model)) == (str(model), "disk")  # not cached: no copy
    assert not root.exists()
    entry = WeightCache(root, budget_bytes=1000).ensure(model)
    assert cached_model_dir(str(model)) == (str(entry), "cache")
    assert cached_model_dir(str(model), root="") == (str(model), "disk")  # explicit root wins
    monkeypatch.delenv(ENV_VAR)
    assert cached_model_dir(str(model), root=str(root)) == (str(entry), "cache")
