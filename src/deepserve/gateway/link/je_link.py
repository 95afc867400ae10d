"""The gateway's view of its job executor's incarnations, from the monitor of
the PUSH socket that carries SubmitRequest / AbortRequest to the JE.

    JobClient PUSH ──connect──> JE inbox (ipc://.../je.sock, bound by the JE)
        └─ socket monitor ──inproc PAIR──> JELink.watch()
              EVENT_DISCONNECTED: the JE process closed its end (it exited or died)
              EVENT_CONNECTED:    a JE has bound the address and we are linked to it

Why the socket and not a message: a JE that is SIGKILLed sends nothing, while
the kernel closes its end of every connection at once, so the PUSH learns of
the death within milliseconds, with no change to the JE and no timeout to tune.

Epochs: every DISCONNECTED ends an incarnation (epoch += 1). A sub-request sent
in an earlier epoch may have died with that JE (unread in its socket, or routed
by it and forgotten with its task table). What is sent while disconnected waits
in the PUSH's pipe (a connecting ZeroMQ socket keeps its pipe across
reconnects, ZMQ_IMMEDIATE off) and reaches the next JE, so it belongs to the
new epoch. On CONNECTED, `on_new_je(epoch)` lets the JobClient resume every
sub-request of an earlier epoch (job_client.py).

Standby heads (je_address lists every head's JE inbox): the PUSH connects to
all with ZMQ_IMMEDIATE, so it queues nothing for a head nobody binds, and
there is no pipe for a submission to wait in while no JE is there: such a
submission is held here (send_or_hold) and flush_forever sends it, in order,
once a JE takes messages (the next head's, after its take-over).

A message sent just before the gateway learns of the death is counted in the
old epoch though it may still sit in the pipe and reach the next JE: it is
then resumed as well, and the JobClient cancels the copy by sending the next
JE an AbortRequest for the old wire id behind it (the pipe keeps their order).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from deepserve.ipc import curve
from deepserve.ipc.sockets import bind_or_connect, endpoints

logger = logging.getLogger(__name__)
FLUSH_S = 0.02
"""How often submissions held for want of a JE (standby heads) are tried again."""


class JELink:
    def __init__(self, on_new_je: Callable[[int], None]):
        self.epoch = 0
        """How many JE incarnations ended since the gateway started."""
        self.is_connected = False
        self.num_connects = 0
        self.to_heads = False
        """Connected to several heads' JEs (ZMQ_IMMEDIATE): nothing waits in the
        PUSH's pipes while none is there; the JobClient keeps what finds none."""
        self._on_new_je = on_new_je
        self._push: zmq.Socket | None = None
        self._address = ""
        self._held: dict[str, bytes] = {}  # key -> a submission no JE took yet (to_heads)
        self._sock: zmq.asyncio.Socket | None = None

    def open(self, ctx: zmq.asyncio.Context, je_address: str
             ) -> tuple[zmq.Socket, zmq.asyncio.Socket]:
        """The PUSH to the JE (a plain socket on ctx's shadow: sends with
        NOBLOCK never await) and the PAIR of its monitor; the caller closes
        both. The monitor is attached before the connect so that the first
        CONNECTED is not missed."""
        push = zmq.Context.shadow(ctx).socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        address = f"inproc://gateway-je-monitor-{uuid.uuid4().hex}"
        push.monitor(address, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._push = push
        self._sock = ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        curve.secure(push, je_address, bind=False)
        bind_or_connect(push, je_address, bind=False)
        self._address = je_address
        self.to_heads = len(endpoints(je_address)) > 1
        return push, self._sock

    async def watch(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                event = parse_monitor_message(frames)["event"]
            except (ValueError, KeyError, IndexError):  # never fatal: a log line
                logger.warning("undecodable socket monitor message dropped")
                continue
            self.on_event(event)

    def on_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED and self.is_connected:
            self.is_connected = False
            self.epoch += 1
            logger.warning("job executor gone (incarnation %d ended): requests wait for the next",
                           self.epoch)
        elif event == zmq.EVENT_CONNECTED:
            self.is_connected = True
            self.num_connects += 1
            if self.epoch:
                logger.warning("job executor back (incarnation %d)", self.epoch)
            self._on_new_je(self.epoch)

    # -- sending -----------------------------------------------------------------
    def send(self, payload: bytes, quiet: bool = False) -> bool:
        """One message to the JE, never waiting: False when the PUSH takes none
        (its high-water mark; with several heads, also no JE there)."""
        try:
            self._push.send(payload, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            if not quiet:
                logger.warning("JE queue full: dropped a message to %s", self._address)
            return False

    def send_or_hold(self, key: str, payload: bytes) -> bool:
        """send(); with several heads a submission that finds no JE is held
        under key (a later one for the key replaces it) for flush_forever, in
        order. False: neither sent nor held."""
        self._held.pop(key, None)
        if self.send(payload, quiet=self.to_heads):
            return True
        if self.to_heads:
            self._held[key] = payload
        return self.to_heads

    def holds(self, key: str) -> bool:
        return key in self._held

    async def flush_forever(self, sending: Callable[[str], bool]) -> None:
        """Every FLUSH_S: the held submissions, in order, while a JE takes them.
        sending(key) just before each: False drops it unsent (its request is gone)."""
        while True:
            await asyncio.sleep(FLUSH_S)
            for key, payload in list(self._held.items()):
                if sending(key) and not self.send(payload, quiet=True):
                    break  # still no JE: the rest wait too, in order
                del self._held[key]

    def close(self) -> None:
        if self._push is not None:
            try:
                self._push.disable_monitor()
            except zmq.ZMQError:
                pass
            self._push = None
