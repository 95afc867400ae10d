"""Owner-only files whatever the umask: the context registry, the resolved run
config and the health log; whole-file replacement by many writers at once."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from deepserve.control.je.contexts import Context, ContextBook
from deepserve.private_files import open_private_append, write_private
from deepserve.supervisor.health_log import HealthLog


@pytest.fixture(autouse=True)
def open_umask():
    old = os.umask(0o022)  # what most hosts have: files world-readable by default
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_replaced_file_is_owner_only_whole_and_leaves_no_temp(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_private(path, b"new")
    assert path.read_bytes() == b"new" and _mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    with pytest.raises(OSError):
        write_private(tmp_path / "missing" / "x.json", b"x")  # nothing written, nothing left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_writers_in_one_process_never_share_a_temp_file(tmp_path):
    """A temp named by pid alone was shared by two writers of one pid: one
    renamed the other's half-written file, or found it gone."""
    path, errors = tmp_path / "contexts.json", []

    def writer(tag: bytes) -> None:
        try:
            for _ in range(200):
                write_private(path, tag * 4096)
        except OSError as e:  # FileNotFoundError: the shared temp renamed away
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(t,)) for t in (b"a", b"b", b"c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    data = path.read_bytes()
    assert errors == [] and len(data) == 4096 and len(set(data)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["contexts.json"]


def test_an_appended_file_is_created_owner_only_and_narrowed(tmp_path):
    new = tmp_path / "new.log"
    with open_private_append(new) as f:
        f.write(b"one\n")
    assert _mode(new) == 0o600
    old = tmp_path / "old.log"
    old.write_text("kept\n")
    os.chmod(old, 0o644)  # a log an earlier version left readable
    with open_private_append(old) as f:
        f.write(b"more\n")
    assert _mode(old) == 0o600 and old.read_text() == "kept\nmore\n"


def test_the_health_log_and_its_rotations_are_owner_only(tmp_path):
    path = tmp_path / "health.jsonl"
    with HealthLog(path, node="n", max_bytes=300, backups=2) as log:
        for i in range(8):  # several rotations
            log.write("supervisor", "cache_tier_enabled", pid=i, name="x" * 40)
    files = sorted(tmp_path.iterdir())
    assert [p.name for p in files] == ["health.jsonl", "health.jsonl.1", "health.jsonl.2"]
    assert all(_mode(p) == 0o600 for p in files)


def test_the_context_registry_is_owner_only(tmp_path):
    book = ContextBook(tmp_path / "contexts.json")
    ctx = Context(book.new_id(), "tenant-a", "m", [1, 2, 3], "secret prompt", None,
                  time.time() + 60)
    book.begin(ctx)
    book.finish(ctx.context_id, True)
    assert _mode(tmp_path / "contexts.json") == 0o600
    assert ContextBook(tmp_path / "contexts.json").get(ctx.context_id, "tenant-a") is not None
