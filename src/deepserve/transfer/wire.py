"""The DistFlow wire: sender DEALER -> receiver ROUTER, one tagged union.

Every message is one msgpack header frame, possibly followed by data frames:

    Hello                        -> Welcome     link check: the receiver's pool shape
    Push  + data frames          -> Ack         tcp: the bytes ride in the frames
    RingChunk                    -> Ack         ring: the bytes are in the sender's
                                                staging segment at `slot`
    Bye                          (no reply)     the sender dropped its staging segment

Data always travels in *canonical order* (see layout.py): rows of `bs * D`
elements, ordered (kv, layer, head, j) where j walks the region's block ids.
A frame holds whole rows. Acks carry the transfer id (and the chunk number
for ring) so a sender can drop stale acks of a transfer it gave up on.

These types live here rather than in `deepserve.messages` because only the
two ends of a DistFlow link speak them.
"""

from __future__ import annotations

from typing import Union

import msgspec


class Hello(msgspec.Struct, tag=True, array_like=True):
    dtype: str


class Welcome(msgspec.Struct, tag=True, array_like=True):
    shape: tuple[int, ...]
    dtype: str


class Push(msgspec.Struct, tag=True, array_like=True, gc=False):
    tid: int
    block_ids: list[int]  # destination blocks
    layers: tuple[int, int]
    nbytes: int  # what the data frames must add up to
    want_checksum: bool


class RingChunk(msgspec.Struct, tag=True, array_like=True, gc=False):
    tid: int
    seq: int  # chunk number within the transfer, from 0
    staging: str  # the sender's staging segment
    slot_offset: int  # byte offset of the chunk in the staging segment
    row0: int  # first canonical row of the chunk
    num_rows: int
    block_ids: list[int]  # destination blocks (whole transfer; sent with seq 0 only)
    layers: tuple[int, int]
    nbytes: int  # whole transfer
    want_checksum: bool
    last: bool


class Bye(msgspec.Struct, tag=True, array_like=True):
    staging: str


class Ack(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    tid: int
    ok: bool
    nbytes: int = 0  # bytes written so far
    seq: int = 0
    checksum: int | None = None
    error: str = ""


ToReceiver = Union[Hello, Push, RingChunk, Bye]
ToSender = Union[Welcome, Ack]
