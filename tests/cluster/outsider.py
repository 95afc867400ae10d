"""A host without the cluster key, run inside its own namespace by
tests/cluster/test_secure_cluster.py. It does what an intruder on the network
would, with real ZeroMQ sockets, and prints one JSON line of what got through:

    python -m tests.cluster.outsider HEAD_HOST:PORT TE_ID DISTFLOW_PORTS_JSON
                                     [PUBLIC_KEY [CLIENT_PUBLIC CLIENT_SECRET [FOREIGN_TE]]]

    list     SUB to the cluster manager's PUB (port+1): TE lists received
    inject   PUSH a TEDown for TE_ID to the cluster manager's inbox (port)
    pull     a DistFlow Hello to every port in DISTFLOW_PORTS_JSON (host:port): Welcomes
With PUBLIC_KEY (the cluster's public half, leaked) every socket is a CURVE
client with a key pair of its own, or CLIENT_PUBLIC / CLIENT_SECRET (a revoked
node's, or a member's); without it, no CURVE at all. With FOREIGN_TE it also
announces a TE of that id (TEUp) to the cluster manager.
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import zmq

from deepserve.messages.control import TEDown, TEInfo, TEUp
from deepserve.transfer.wire import Hello

LISTEN_S = 3.0


def _socket(ctx: zmq.Context, kind: int, public: bytes | None,
            pair: tuple[bytes, bytes] | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.linger = 0
    if public is not None:
        sock.curve_publickey, sock.curve_secretkey = pair or zmq.curve_keypair()
        sock.curve_serverkey = public
    return sock


def main(head: str, te_id: str, distflow: list[str], public: bytes | None,
         pair: tuple[bytes, bytes] | None = None, foreign: str = "") -> dict:
    host, port = head.rsplit(":", 1)
    ctx = zmq.Context()
    try:
        sub = _socket(ctx, zmq.SUB, public, pair)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{host}:{int(port) + 1}")
        push = _socket(ctx, zmq.PUSH, public, pair)
        push.connect(f"tcp://{host}:{port}")
        if push.poll(1000, zmq.POLLOUT):
            push.send(msgspec.msgpack.encode(TEDown(te_id=te_id, reason="outsider")), zmq.NOBLOCK)
            if foreign:
                push.send(msgspec.msgpack.encode(TEUp(info=TEInfo(
                    te_id=foreign, model="tiny", address="tcp://10.9.9.9:1"))), zmq.NOBLOCK)
        dealers = []
        for address in distflow:
            dealer = _socket(ctx, zmq.DEALER, public, pair)
            dealer.connect(f"tcp://{address}")
            if dealer.poll(500, zmq.POLLOUT):
                dealer.send_multipart([msgspec.msgpack.encode(Hello(dtype="bfloat16"))],
                                      zmq.NOBLOCK)
            dealers.append(dealer)
        listed = welcomed = 0
        deadline = time.monotonic() + LISTEN_S
        poller = zmq.Poller()
        for sock in (sub, *dealers):
            poller.register(sock, zmq.POLLIN)
        while time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                sock.recv_multipart()
                if sock is sub:
                    listed += 1
                else:
                    welcomed += 1
        return {"listed": listed, "welcomed": welcomed, "pulled_from": len(distflow)}
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    key = sys.argv[4].encode() if len(sys.argv) > 4 else None
    own = (sys.argv[5].encode(), sys.argv[6].encode()) if len(sys.argv) > 6 else None
    foreign_te = sys.argv[7] if len(sys.argv) > 7 else ""
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), key, own,
                          foreign_te)), flush=True)
