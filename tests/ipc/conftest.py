"""Per-test run ids and scratch dirs; every test must leave /dev/shm clean."""

from __future__ import annotations

import uuid

import pytest

from deepserve.ipc.segments import list_segments, unlink_segment


@pytest.fixture
def run_id() -> str:
    """A fresh run id; afterwards no `deepserve-{run_id}*` segment may remain."""
    value = uuid.uuid4().hex[:10]
    yield value
    leftovers = list_segments(f"deepserve-{value}")
    for name in leftovers:
        unlink_segment(name)
    assert not leftovers, f"test left shared-memory segments behind: {leftovers}"
