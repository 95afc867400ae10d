"""HostNet: hosts reach each other's addresses, loopback stays private, nothing is left.

Every process here is plain Python (no torch), so the module runs in about a second.
"""

from __future__ import annotations

import time
import subprocess
import sys

import pytest

from deepserve.drill import netns
from deepserve.drill.netns import SUBNET, HostNet, list_netns
from tests.cluster.netns import hosts_or_skip

WAIT_S = 10.0


def _serve(hosts: HostNet, host: int, addr: str) -> tuple[subprocess.Popen, int]:
    """An echo server inside `host` bound to addr; its process and port."""
    server = hosts.python(host, "tests.cluster.echo", "serve", addr, stdout=subprocess.PIPE,
                          text=True)
    return server, int(server.stdout.readline())


def _send(hosts: HostNet, host: int, addr: str, port: int, text: str) -> str:
    """What `send` printed inside `host`: the echo, or the connect error's name."""
    client = hosts.python(host, "tests.cluster.echo", "send", addr, str(port), text,
                          stdout=subprocess.PIPE, text=True)
    out, _ = client.communicate(timeout=WAIT_S)
    return out.strip()


@pytest.mark.parametrize("a, b", [(0, 1), (2, 0)])
def test_host_reaches_another_hosts_address(hosts, a, b):
    server, port = _serve(hosts, b, hosts.addresses[b])
    assert _send(hosts, a, hosts.addresses[b], port, f"hello {a}->{b}") == f"hello {a}->{b}"
    client_ip = server.stdout.readline().strip()
    assert HostNet.reap(server) == 0
    assert client_ip == hosts.addresses[a]  # it came from host a, over the bridge


def test_loopback_is_private_to_each_host(hosts):
    """127.0.0.1 of host 1 is not there for host 0: why cross-host sockets bind host addresses."""
    server, port = _serve(hosts, 1, "127.0.0.1")
    try:
        assert _send(hosts, 0, "127.0.0.1", port, "x") == "ConnectionRefusedError"
        assert _send(hosts, 1, "127.0.0.1", port, "y") == "y"
    finally:
        HostNet.reap(server)


def test_run_pid_is_the_programs_own(hosts):
    """ip execs argv, so killing the Popen's pid kills the program, nothing else."""
    proc = hosts.run(0, [sys.executable, "-c", "import os; print(os.getpid())"],
                     stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert int(out) == proc.pid


def test_root_namespace_is_untouched(hosts):
    """No address of our subnet, and no device whose other end is one of our namespaces."""
    def root(*args: str) -> str:
        return subprocess.run(["ip", "-o", *args], capture_output=True, text=True,
                              timeout=WAIT_S, check=True).stdout

    assert f"{SUBNET}." not in root("addr", "show")
    assert hosts.tag not in root("link", "show")


def test_close_kills_reaps_and_deletes():
    """close() kills what it started, waits for a grandchild that outlives it, deletes all."""
    with hosts_or_skip(2) as net:
        sleeper = net.run(1, ["sh", "-c", "sleep 0.5 & exec sleep 60"])
        names = [net.bridge, *net.names]
        assert set(names) <= list_netns()
        deadline = time.monotonic() + 5.0  # `ip netns exec` enters the namespace, then execs
        while sleeper.pid not in net.pids(net.names[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in net.pids(net.names[1])
    assert sleeper.returncode is not None  # killed by its pid, and reaped
    assert not set(names) & list_netns()


def _ip_refusing(refused: tuple[str, ...]):
    """`ip` where commands containing `refused` fail (as in a container without
    CAP_SYS_ADMIN, or a kernel without bridges) and everything else does nothing."""
    def ip(*args: str) -> str:
        if refused and all(word in args for word in refused):
            raise RuntimeError("Operation not permitted")
        return ""
    return ip


@pytest.mark.parametrize("euid, refused, reason", [
    (1000, (), "needs root"),
    (0, ("netns", "add"), "not permitted here"),
    (0, ("type", "bridge"), "cannot make a bridge"),
])
def test_skips_with_the_reason_where_netns_is_unavailable(monkeypatch, euid, refused, reason):
    monkeypatch.setattr(netns.os, "geteuid", lambda: euid)
    monkeypatch.setattr(netns.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(netns, "_ip", _ip_refusing(refused))
    with pytest.raises(pytest.skip.Exception, match=reason):
        with hosts_or_skip(2):
            pass
