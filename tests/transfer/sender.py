"""A DistFlow sender process for the cross-host tests (started inside a host namespace).

    python -m tests.transfer.sender SEGMENT SHAPE_JSON DTYPE TIMEOUT_S FD

It maps the source pool the test process created (SEGMENT: /dev/shm is
shared across network namespaces, sockets are not), then answers orders from
the pipe on fd FD one at a time:

    Link(peer_id, endpoint, backend) -> Reply(backend)   the backend chosen
    Send(peer_id, src, dst)          -> Reply(result)    checksummed transfer
    either one failing               -> Reply(error)     "TransferError: ..."

EOF on the pipe (the test is done, or gone) ends it; it releases in reverse order.
"""

from __future__ import annotations

import math
import sys
from multiprocessing.connection import Connection
from typing import Union

import msgspec
import torch

from deepserve.ipc.segments import attach_segment
from deepserve.transfer import DistFlow, PeerEndpoint, PoolRegion, TransferError, TransferResult

WAIT_S = 60.0  # the longest a transfer or an idle pipe is waited for


class Link(msgspec.Struct, tag=True):
    peer_id: str
    endpoint: PeerEndpoint
    backend: str


class Send(msgspec.Struct, tag=True):
    peer_id: str
    src: PoolRegion
    dst: PoolRegion


class Reply(msgspec.Struct, omit_defaults=True):
    backend: str = ""
    result: TransferResult | None = None
    error: str = ""


Order = Union[Link, Send]


def _execute(flow: DistFlow, order: Order) -> Reply:
    try:
        if isinstance(order, Link):
            return Reply(backend=flow.link(order.peer_id, order.endpoint, order.backend))
        handle = flow.transfer(order.peer_id, order.src, order.dst, checksum=True)
        return Reply(result=handle.wait(WAIT_S))
    except TransferError as e:
        return Reply(error=f"TransferError: {e}")


def _serve(flow: DistFlow, conn: Connection) -> None:
    dec = msgspec.msgpack.Decoder(Order)
    try:
        while conn.poll(WAIT_S):
            conn.send_bytes(msgspec.msgpack.encode(_execute(flow, dec.decode(conn.recv_bytes()))))
    except EOFError:
        pass


def main(segment: str, shape_json: str, dtype: str, timeout_s: str, fd: str) -> None:
    shape = msgspec.json.decode(shape_json, type=tuple[int, ...])
    seg = attach_segment(segment)
    try:
        pool = torch.frombuffer(seg.buf, dtype=getattr(torch, dtype),
                                count=math.prod(shape)).view(shape)
        flow = DistFlow(pool, timeout_s=float(timeout_s))
        try:
            _serve(flow, Connection(int(fd)))
        finally:
            flow.close()
        del pool, flow
    finally:
        seg.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
