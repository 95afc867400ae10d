"""Fork: a node pulls a model's files from a peer node that holds them
(DeepServe's NPU-fork, here over tcp between hosts; cache/weight_fork.py).

    fetching node (DEALER) ──WeightList(path)──────────────> peer's WeightServer (ROUTER)
                           <─WeightFiles([(name, size)])───
                           ──WeightGet(path, name, offset, length)── (a window in flight)
                           <─WeightChunk(name, offset, crc32) + the bytes (a second frame)

`path` is the model's directory as the head's [[model]] names it (the key on
every node); each node serves only the directories of the models it holds
(and relays a fork of one under way), and only their top-level files. A
reply with `error` set refuses the request; one with `retry` (a relay that
has not received it yet) asks for it again shortly.
"""

from __future__ import annotations

import msgspec

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)


class WeightList(msgspec.Struct, tag="weight_list", **_STRUCT):
    path: str


class WeightGet(msgspec.Struct, tag="weight_get", **_STRUCT):
    path: str
    name: str
    offset: int
    length: int


class WeightFiles(msgspec.Struct, tag="weight_files", **_STRUCT):
    files: list[tuple[str, int]] = []
    """(file name, size in bytes) of every top-level file of the model's directory."""
    error: str = ""
    retry: bool = False
    """A relay whose own fork has no listing yet: ask again shortly."""


class WeightChunk(msgspec.Struct, tag="weight_chunk", **_STRUCT):
    """The header of one chunk; the bytes follow in the next frame."""

    name: str
    offset: int
    crc: int = 0
    """zlib.crc32 of the bytes."""
    error: str = ""
    retry: bool = False
    """A relay has not received this chunk yet (no bytes follow): ask again shortly."""


ToWeightServer = WeightList | WeightGet
FromWeightServer = WeightFiles | WeightChunk
