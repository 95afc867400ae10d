"""A pool-owning peer process for the DistFlow tests (spawned, so module-level).

The child creates its pool in a named segment, serves it with a
DistFlowReceiver, sends its endpoint (msgspec JSON) up the pipe, and stays
until the parent sends "stop" (or 60 s pass), then releases in reverse order.
"""

from __future__ import annotations

import math

import msgspec
import torch

from deepserve.ipc.segments import create_segment, unlink_segment
from deepserve.transfer import DistFlowReceiver

WAIT_S = 60.0


def serve_pool(name: str, shape: tuple[int, ...], dtype: str, conn) -> None:
    dt = getattr(torch, dtype)
    seg = create_segment(name, math.prod(shape) * dt.itemsize)
    try:
        pool = torch.frombuffer(seg.buf, dtype=dt).view(shape)
        receiver = DistFlowReceiver(pool)
        try:
            conn.send_bytes(msgspec.json.encode(receiver.endpoint(shm_name=name)))
            if conn.poll(WAIT_S):
                conn.recv_bytes()
        finally:
            receiver.close()
        del pool
    finally:
        seg.close()
        unlink_segment(name)
