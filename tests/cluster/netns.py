"""The cross-host tests' hosts: drill/netns.py's HostNet, skipped where it cannot be made."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from deepserve.drill.netns import HostNet, NetnsUnavailable

@contextlib.contextmanager
def hosts_or_skip(num_hosts: int) -> Iterator[HostNet]:
    """A HostNet that is up for the block and gone after it; skips the test where it cannot be."""
    net = HostNet(num_hosts)
    try:
        try:
            net.up()
        except NetnsUnavailable as e:
            pytest.skip(f"cross-host tests need network namespaces: {e}")
        yield net
    finally:
        net.close()
