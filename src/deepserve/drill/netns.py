"""HostNet: a few "hosts" as network namespaces on one bridge, for cross-host tests
and the partition-head drill (drill/partition.py).

    root namespace: nothing of ours (no device, address or route)

    {tag}-br  br0 -+- p0 ====veth==== eth0  {tag}-h0  10.213.77.1/24  lo up
                   +- p1 ====veth==== eth0  {tag}-h1  10.213.77.2/24  lo up
                   +- p2 ====veth==== eth0  {tag}-h2  10.213.77.3/24  lo up

Why: across hosts, DistFlow and ZeroMQ tcp must bind the host's own address;
a socket bound to 127.0.0.1 in one namespace is as unreachable from another
as from another machine, so these tests catch a loopback address that
leaked into a cross-host path. Namespaces split the network only: /dev/shm,
files and pids stay shared, so a test that means tcp must force it.

The bridge lives in a namespace of its own and every device is created
inside a namespace we made, so the root namespace is never touched and
10.213.77.0/24 is routed nowhere else: packets to it can only travel between
our hosts. Deleting the namespaces destroys the veths and the bridge.

Names: tag = ds-<pid>-<random>, unique per run (parallel runs never
collide; a leftover's pid says which run left it).

Processes: `run(i, argv)` starts `ip netns exec {tag}-h{i} argv`; ip execs
argv, so the Popen's pid is the program's own and killing it kills the
program. `close()` kills only those pids, reaps them with bounded waits,
waits (bounded) for their own children to follow, then deletes the
namespaces, and raises if a process or a namespace of ours is left behind.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Sequence


ROOT = Path(__file__).resolve().parents[3]
SUBNET = "10.213.77"  # a /24 that exists only inside our namespaces
MAX_HOSTS = 16
IP_TIMEOUT_S = 10.0
REAP_S = 10.0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not Linux, not root, no `ip`, not permitted)."""


def _ip(*args: str) -> str:
    """Run `ip ARGS` (bounded); its stdout, or RuntimeError carrying its stderr."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def list_netns() -> set[str]:
    """Names of every network namespace `ip netns` knows (ours and others')."""
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}


def unavailable_reason() -> str | None:
    """Why this machine cannot host a HostNet, or None when it may try."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


class HostNet:
    """K hosts (network namespaces) on one bridge; see the module docstring."""

    def __init__(self, num_hosts: int):
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in [1, {MAX_HOSTS}], got {num_hosts}")
        self.tag = f"ds-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge = f"{self.tag}-br"
        self.names = [f"{self.tag}-h{i}" for i in range(num_hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(num_hosts)]
        self._made: list[str] = []  # namespaces created, in order
        self._procs: list[subprocess.Popen] = []

    # -- building ------------------------------------------------------------

    def up(self) -> HostNet:
        """Create the bridge namespace, then every host; NetnsUnavailable where that cannot be."""
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        try:
            self._add_netns(self.bridge)
        except RuntimeError as e:  # EPERM in a container, no netns support, ...
            raise NetnsUnavailable(f"ip netns add is not permitted here ({e})") from e
        try:
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        except RuntimeError as e:  # a kernel without the bridge module
            raise NetnsUnavailable(f"cannot make a bridge device ({e})") from e
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for i in range(len(self.names)):
            self._add_host(i)
        return self

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _add_host(self, i: int) -> None:
        """Host i: a namespace, lo up, eth0 (veth) into the bridge with address .i+1."""
        name, port = self.names[i], f"p{i}"
        self._add_netns(name)
        _ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", name)  # created inside the bridge namespace, never in the root one
        _ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")

    # -- processes -----------------------------------------------------------

    def run(self, host: int, argv: Sequence[str], **popen_kw) -> subprocess.Popen:
        """Start argv inside host `host` (cwd: the repository root unless given).

        The caller may stop it; `close()` reaps it in any case."""
        popen_kw.setdefault("cwd", ROOT)
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], **popen_kw)
        self._procs.append(proc)
        return proc

    def python(self, host: int, module: str, *args: str, **popen_kw) -> subprocess.Popen:
        """`python -m module args` inside host `host`, with this interpreter."""
        return self.run(host, [sys.executable, "-m", module, *args], **popen_kw)

    def python_piped(self, host: int, module: str,
                     *args: str) -> tuple[Connection, subprocess.Popen]:
        """`python()` plus a duplex pipe; the child's end is its last argument (an fd number).

        A multiprocessing child cannot be placed in another namespace, but an
        inherited fd crosses `ip netns exec`; EOF on it tells the child we are gone."""
        ours, theirs = mp.Pipe()
        try:
            fd = theirs.fileno()
            proc = self.python(host, module, *args, str(fd), pass_fds=(fd,))
        finally:
            theirs.close()
        return ours, proc

    @staticmethod
    def reap(proc: subprocess.Popen, timeout_s: float = REAP_S) -> int:
        """Wait (bounded) for proc to exit; kill it, by its pid, if it does not. Its exit code."""
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout_s)

    @classmethod
    def stop(cls, procs, timeout_s: float = REAP_S) -> None:
        """SIGTERM every process still running (all at once, so they stop side by
        side), then reap each (bounded, killed by its pid past it)."""
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            cls.reap(proc, timeout_s)

    def kill_host(self, host: int) -> list[int]:
        """A host dies: SIGKILL every process inside it at once (the namespace is
        ours, so every pid in it is one of ours or their children). The pids."""
        pids = self.pids(self.names[host])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    # -- looking -------------------------------------------------------------

    def pids(self, name: str) -> list[int]:
        """Pids of every process inside namespace `name` (ours or not)."""
        return [int(p) for p in _ip("netns", "pids", name).split()]

    def eth_bytes(self, host: int) -> tuple[int, int]:
        """(rx, tx) bytes counted on host `host`'s eth0 so far."""
        (link,) = json.loads(_ip("-n", self.names[host], "-j", "-s", "link", "show", "dev", "eth0"))
        return link["stats64"]["rx"]["bytes"], link["stats64"]["tx"]["bytes"]

    def connections(self, host: int) -> set[tuple[str, str]]:
        """Established TCP connections in host `host`: {("local ip:port", "peer ip:port")}."""
        done = subprocess.run(["ss", "-N", self.names[host], "-Htn", "state", "established"],
                              capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=True)
        return {(f[-2], f[-1]) for f in (line.split() for line in done.stdout.splitlines()) if f}

    # -- teardown ------------------------------------------------------------

    def _wait_empty(self, deadline: float) -> dict[str, list[int]]:
        """Wait until no process is left in our namespaces; what is still there at the deadline.

        Our children's own children (multiprocessing's resource tracker, say)
        exit by themselves once their parent is gone, a moment after it."""
        while True:
            strays = {name: pids for name in self._made if (pids := self.pids(name))}
            if not strays or time.monotonic() > deadline:
                return strays
            time.sleep(0.02)

    def close(self) -> None:
        """Reap our processes, delete our namespaces; AssertionError if anything of ours is left."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            self.reap(proc)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        strays = self._wait_empty(time.monotonic() + REAP_S)
        for name in reversed(self._made):  # hosts first: that destroys their veths
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", name)
        left = set(self._made) & list_netns()
        self._procs.clear()
        self._made.clear()
        assert not strays, f"processes outlived their parents in our namespaces: {strays}"
        assert not left, f"could not delete namespaces {sorted(left)}"
