"""PeerSockets: the master's PUSH sockets to other TEs' masters (PD messages).

    master ──PrefillOrder / KVReady / KVAck──> [pd PULL] of the peer at `address`

One socket per peer address, connected on first use. A send waits at most
`timeout_s` for a peer that is gone (the deadlines on both sides of the PD
protocol clean up after it), so a dead peer never stalls the master's loop
for long.
"""

from __future__ import annotations

import logging

import zmq

from deepserve.ipc.sockets import PushSocket

log = logging.getLogger(__name__)


class PeerSockets:
    def __init__(self, ctx: zmq.Context, timeout_s: float = 1.0):
        self.ctx, self.timeout_s = ctx, timeout_s
        self._sockets: dict[str, PushSocket] = {}

    def put(self, address: str, msg) -> bool:
        """False (and a warning) if the peer did not take it in time."""
        if address not in self._sockets:
            self._sockets[address] = PushSocket(self.ctx, address, bind=False)
        try:
            self._sockets[address].put(msg, timeout=self.timeout_s)
        except TimeoutError:
            log.warning("peer %s does not take %s", address, type(msg).__name__)
            return False
        return True

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets = {}
