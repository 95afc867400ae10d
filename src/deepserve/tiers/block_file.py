"""The disk tier's block files: one full block (all layers, all KV heads) per file.

    DIR/<model key>/<hh>/<hash as 16 hex digits>.kv    hh: its first two digits

    offset  size  field
    0       8     magic b"DSKVBLK2" (b"DSKVBLK1": no trailer, still read whole)
    8       8     block hash (int64, little-endian)
    16      8     payload bytes (uint64)
    24      4     crc32 of the trailer (version 1: of the payload) (uint32)
    28      20    geometry: num_layers, num_kv_heads, block_size, head_dim (uint32),
                  itemsize (uint32)
    48      16    dtype name, NUL-padded ASCII
    64      P     payload: the block as (2, L, H, bs, D), C order
    64+P    4 L   trailer: crc32 of each layer's K slice then V slice (uint32)

One read serves a whole block (DualPath's "full block" layout); a layered
reader (LayerFile) reads one layer's K and V slices at a time and checks each
against the trailer, so a layer-wise load never holds a whole block. A file is
written whole to a temporary name in the same directory, optionally fsynced,
then renamed into place, so a reader sees a complete file or none.

fsync policy ("never" by default): the cache is soft state, so a power loss
may lose files that were renamed but not yet on the platter; a file torn by
a crash fails its checksum and is a miss. "always" fsyncs the file before
the rename and its directory after it, for durability across power loss.

A file whose header or checksum does not match raises BlockCorrupt: the
caller counts it as a miss (and reports it), never as KV.
"""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from pathlib import Path

from deepserve.messages.cache import BlockGeometry

MAGIC = b"DSKVBLK2"
MAGIC_V1 = b"DSKVBLK1"  # written before the layer trailer: read whole only
_HEADER = struct.Struct("<8sqQI5I16s")
HEADER_BYTES = 64
FSYNC_POLICIES = ("never", "always")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class BlockCorrupt(ValueError):
    """A block file that is not what its name says (header or checksum)."""


class NoLayerIndex(ValueError):
    """A version-1 block file: whole, but without the per-layer checksums a
    layered read needs (a miss for it, not a corruption)."""


def block_nbytes(geometry: BlockGeometry) -> int:
    g = geometry
    return 2 * g.num_layers * g.num_kv_heads * g.block_size * g.head_dim * _ITEMSIZE[g.dtype]


def hash_name(block_hash: int) -> str:
    return f"{block_hash & (2**64 - 1):016x}"


def block_path(disk_dir: str | Path, block_hash: int) -> Path:
    name = hash_name(block_hash)
    return Path(disk_dir) / name[:2] / f"{name}.kv"


def hash_of_path(path: Path) -> int | None:
    """The block hash a file name stands for (None: not a block file)."""
    stem = path.name.removesuffix(".kv")
    if path.suffix != ".kv" or len(stem) != 16:
        return None
    try:
        value = int(stem, 16)
    except ValueError:
        return None
    return value - 2**64 if value >= 2**63 else value


def _header(block_hash: int, geometry: BlockGeometry, payload_len: int, crc: int) -> bytes:
    g = geometry
    head = _HEADER.pack(MAGIC, block_hash, payload_len, crc, g.num_layers, g.num_kv_heads,
                        g.block_size, g.head_dim, _ITEMSIZE[g.dtype], g.dtype.encode())
    return head.ljust(HEADER_BYTES, b"\0")


def write_block(disk_dir: str | Path, block_hash: int, geometry: BlockGeometry,
                payload: memoryview | bytes, fsync: str = "never") -> int:
    """Write one block file atomically; the bytes on disk. OSError (ENOSPC:
    the disk is full) leaves no file behind."""
    if len(payload) != block_nbytes(geometry):
        raise ValueError(f"payload of {len(payload)} bytes for a block of "
                         f"{block_nbytes(geometry)}")
    path = block_path(disk_dir, block_hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    trailer = _layer_crcs(geometry, memoryview(payload))
    head = _header(block_hash, geometry, len(payload), zlib.crc32(trailer))
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(payload)
            f.write(trailer)
            if fsync == "always":
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync == "always":
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return HEADER_BYTES + len(payload) + len(trailer)


def layer_nbytes(geometry: BlockGeometry) -> int:
    """One layer's K (or V) slice of a block, all heads."""
    return block_nbytes(geometry) // (2 * geometry.num_layers)


def _layer_crcs(geometry: BlockGeometry, payload: memoryview) -> bytes:
    n, layers = layer_nbytes(geometry), geometry.num_layers
    crcs = [zlib.crc32(payload[(layers + j) * n:(layers + j + 1) * n],
                       zlib.crc32(payload[j * n:(j + 1) * n])) for j in range(layers)]
    return struct.pack(f"<{layers}I", *crcs)


def _check_header(path: Path, head: bytes, block_hash: int, geometry: BlockGeometry
                  ) -> tuple[bytes, int]:
    """(magic, its crc field) of a header that names this block and geometry."""
    if len(head) != HEADER_BYTES:
        raise BlockCorrupt(f"{path}: short header")
    magic, h, nbytes, crc, layers, heads, bs, dim, itemsize, dtype = \
        _HEADER.unpack(head[:_HEADER.size])
    g = geometry
    if (magic not in (MAGIC, MAGIC_V1) or h != block_hash or nbytes != block_nbytes(g)
            or (layers, heads, bs, dim) != (g.num_layers, g.num_kv_heads, g.block_size,
                                            g.head_dim)
            or dtype.rstrip(b"\0").decode(errors="replace") != g.dtype
            or itemsize != _ITEMSIZE[g.dtype]):
        raise BlockCorrupt(f"{path}: header does not match block {hash_name(block_hash)}")
    return magic, crc


def read_block(disk_dir: str | Path, block_hash: int, geometry: BlockGeometry,
               out: memoryview | None = None) -> bytes | memoryview:
    """The payload of the block's file (into `out` if given, which must be
    block_nbytes long). FileNotFoundError: no such file; BlockCorrupt: a
    file that fails its header or checksum check."""
    path = block_path(disk_dir, block_hash)
    size = block_nbytes(geometry)
    with open(path, "rb") as f:
        magic, crc = _check_header(path, f.read(HEADER_BYTES), block_hash, geometry)
        buf = out if out is not None else memoryview(bytearray(size))
        got = f.readinto(buf)
        trailer = f.read(4 * geometry.num_layers + 1) if magic == MAGIC else f.read(1)
        if got != size or len(trailer) != (4 * geometry.num_layers if magic == MAGIC else 0):
            raise BlockCorrupt(f"{path}: {got} payload bytes and a {len(trailer)}-byte "
                               f"trailer, expected {size} and {4 * geometry.num_layers}")
    if magic == MAGIC_V1:
        ok = zlib.crc32(buf) == crc
    else:  # the header checks the trailer, the trailer every layer
        ok = zlib.crc32(trailer) == crc and _layer_crcs(geometry, memoryview(buf)) == trailer
    if not ok:
        raise BlockCorrupt(f"{path}: checksum mismatch")
    return buf


class LayerFile:
    """One block file open for layered reads: the header is checked and the
    trailer read at open (FileNotFoundError, BlockCorrupt, NoLayerIndex), and
    the descriptor kept, so a file removed meanwhile is still read whole.
    read_layer(j, k_out, v_out) fills layer j's K and V slices (all heads)
    and checks them against the trailer (BlockCorrupt)."""

    def __init__(self, disk_dir: str | Path, block_hash: int, geometry: BlockGeometry):
        self.path, self.geometry = block_path(disk_dir, block_hash), geometry
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            head = os.pread(self.fd, HEADER_BYTES, 0)
            magic, crc = _check_header(self.path, head, block_hash, geometry)
            if magic != MAGIC:
                raise NoLayerIndex(f"{self.path}: a version-1 file has no layer checksums")
            size, layers = block_nbytes(geometry), geometry.num_layers
            trailer = os.pread(self.fd, 4 * layers + 1, HEADER_BYTES + size)
            if len(trailer) != 4 * layers or zlib.crc32(trailer) != crc:
                raise BlockCorrupt(f"{self.path}: its trailer ({len(trailer)} bytes) fails "
                                   f"its checksum")
            self.crcs = struct.unpack(f"<{layers}I", trailer)
        except BaseException:
            os.close(self.fd)
            raise

    def read_layer(self, layer: int, k_out: memoryview, v_out: memoryview) -> None:
        n, layers = layer_nbytes(self.geometry), self.geometry.num_layers
        crc = 0
        for out, index in ((k_out, layer), (v_out, layers + layer)):
            got = os.preadv(self.fd, [out], HEADER_BYTES + index * n)
            if got != n:
                raise BlockCorrupt(f"{self.path}: layer {layer}: {got} bytes, expected {n}")
            crc = zlib.crc32(out, crc)
        if crc != self.crcs[layer]:
            raise BlockCorrupt(f"{self.path}: layer {layer} checksum mismatch")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def scan_blocks(disk_dir: str | Path) -> list[tuple[int, int, float]]:
    """(hash, bytes, mtime) of every block file under disk_dir (a restarted
    node finds its blocks); leftover temporary files are removed."""
    root = Path(disk_dir)
    if not root.is_dir():
        return []
    found = []
    for sub in root.iterdir():
        if not sub.is_dir():
            continue
        for path in sub.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            h = hash_of_path(path)
            if h is None:
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((h, st.st_size, st.st_mtime))
    return found


def delete_block(disk_dir: str | Path, block_hash: int) -> None:
    block_path(disk_dir, block_hash).unlink(missing_ok=True)
