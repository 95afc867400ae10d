"""Named shared-memory segments: names, permissions, unlink, resource tracker."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from deepserve.ipc import segments
from deepserve.ipc.segments import (attach_segment, create_segment, list_segments,
                                    segment_name, unlink_segment)


def test_segment_name_is_prefixed_and_validated(run_id):
    assert segment_name(run_id, "ring") == f"deepserve-{run_id}-ring"
    for purpose in ("a/b", "x" * 300, "nul\0"):
        with pytest.raises(ValueError):
            segment_name(run_id, purpose)


def test_create_is_owner_only_zeroed_and_attachable(run_id):
    name = segment_name(run_id, "seg")
    shm = create_segment(name, 4096)
    try:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
        assert bytes(shm.buf[:4096]) == bytes(4096)
        shm.buf[:5] = b"hello"
        other = attach_segment(name)
        assert bytes(other.buf[:5]) == b"hello"
        other.close()
        assert list_segments(f"deepserve-{run_id}") == [name]
        with pytest.raises(FileExistsError):
            create_segment(name, 4096)
    finally:
        shm.close()
        unlink_segment(name)
    assert list_segments(f"deepserve-{run_id}") == []
    unlink_segment(name)  # already gone: fine
    with pytest.raises(FileNotFoundError):
        attach_segment(name)


_TRACKER_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("segments", sys.argv[1])
segments = importlib.util.module_from_spec(spec)
spec.loader.exec_module(segments)
attached = segments.attach_segment(sys.argv[2])
attached.close()
created = segments.create_segment(sys.argv[3], 4096)
created.close()
"""


def test_resource_tracker_neither_unlinks_nor_warns(run_id):
    """A process that attaches, or creates untracked, then exits leaves the
    segments alone and prints no 'leaked shared_memory' warning."""
    theirs, ours = segment_name(run_id, "parent"), segment_name(run_id, "child")
    shm = create_segment(theirs, 4096)
    try:
        # Load segments.py by path: importing the deepserve package pulls in
        # torch, which would cost seconds and is not what is tested here.
        result = subprocess.run(
            [sys.executable, "-c", _TRACKER_CHILD, segments.__file__, theirs, ours],
            capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "leaked" not in result.stderr and "resource_tracker" not in result.stderr, \
            result.stderr
        assert list_segments(f"deepserve-{run_id}") == sorted([theirs, ours])
    finally:
        shm.close()
        unlink_segment(theirs)
        unlink_segment(ours)
