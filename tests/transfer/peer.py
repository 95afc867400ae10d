"""A pool-owning peer process for the DistFlow tests (spawned, so module-level).

The child creates its pool in a named segment, serves it with a
DistFlowReceiver bound to `bind`, sends its endpoint (msgspec JSON) up the
pipe, and stays until the parent sends "stop" (or 60 s pass, or the pipe
closes), then releases in reverse order.

Spawned by multiprocessing (conftest.Peer), or, for the cross-host tests,
started inside a host namespace (conftest.HostPeer) as

    python -m tests.transfer.peer NAME SHAPE_JSON DTYPE BIND FD

with the pipe inherited as fd FD, since a multiprocessing child cannot be
put in another network namespace.
"""

from __future__ import annotations

import math
import sys
from multiprocessing.connection import Connection

import msgspec
import torch

from deepserve.ipc.segments import create_segment, unlink_segment
from deepserve.transfer import DistFlowReceiver
from deepserve.transfer.receiver import LOOPBACK

WAIT_S = 60.0


def serve_pool(name: str, shape: tuple[int, ...], dtype: str, conn, bind: str = LOOPBACK) -> None:
    dt = getattr(torch, dtype)
    seg = create_segment(name, math.prod(shape) * dt.itemsize)
    try:
        pool = torch.frombuffer(seg.buf, dtype=dt).view(shape)
        receiver = DistFlowReceiver(pool, bind=bind)
        try:
            conn.send_bytes(msgspec.json.encode(receiver.endpoint(shm_name=name)))
            if conn.poll(WAIT_S):
                conn.recv_bytes()
        except EOFError:  # the parent is gone: release all the same
            pass
        finally:
            receiver.close()
        del pool
    finally:
        seg.close()
        unlink_segment(name)


if __name__ == "__main__":
    _name, _shape, _dtype, _bind, _fd = sys.argv[1:]
    serve_pool(_name, msgspec.json.decode(_shape, type=tuple[int, ...]), _dtype,
               Connection(int(_fd)), _bind)
