"""A one-shot TCP echo pair for the HostNet tests, run inside host namespaces.

    python -m tests.cluster.echo serve ADDR    prints its port; echoes one
                                               connection; prints the client's ip
    python -m tests.cluster.echo send ADDR PORT TEXT
                                               prints the echo, or the error's name

The server names the client's address so a test can tell which host the
bytes came from, not just that some bytes came back.
"""

from __future__ import annotations

import socket
import sys

WAIT_S = 10.0  # every accept/connect/recv is bounded


def serve(addr: str) -> None:
    with socket.create_server((addr, 0)) as srv:
        srv.settimeout(WAIT_S)
        print(srv.getsockname()[1], flush=True)
        conn, (client, _) = srv.accept()
        with conn:
            conn.settimeout(WAIT_S)
            while data := conn.recv(4096):
                conn.sendall(data)
        print(client, flush=True)


def send(addr: str, port: str, text: str) -> None:
    try:
        with socket.create_connection((addr, int(port)), timeout=WAIT_S) as s:
            s.sendall(text.encode())
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while data := s.recv(4096):
                chunks.append(data)
    except OSError as e:
        print(type(e).__name__, flush=True)
        return
    print(b"".join(chunks).decode(), flush=True)


if __name__ == "__main__":
    {"serve": serve, "send": send}[sys.argv[1]](*sys.argv[2:])
