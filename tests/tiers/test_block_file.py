"""Disk-tier block files: round trip, atomic writes, every kind of corruption."""

import os

import pytest

from deepserve.messages.cache import BlockGeometry
from deepserve.tiers import block_file as bf

GEOM = BlockGeometry(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32")


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(bf.block_nbytes(GEOM)))


def test_round_trip_and_path_layout(tmp_path):
    h = -123456789  # negative hashes name files by their unsigned value
    nbytes = bf.write_block(tmp_path, h, GEOM, payload(1))
    path = bf.block_path(tmp_path, h)
    assert path.parent.name == path.name[:2] and path.stat().st_size == nbytes
    assert bytes(bf.read_block(tmp_path, h, GEOM)) == payload(1)
    assert bf.hash_of_path(path) == h
    assert bf.scan_blocks(tmp_path) == [(h, nbytes, path.stat().st_mtime)]


def test_fsync_always_writes_the_same_file(tmp_path):
    bf.write_block(tmp_path, 5, GEOM, payload(2), fsync="always")
    assert bytes(bf.read_block(tmp_path, 5, GEOM)) == payload(2)


def test_a_flipped_payload_byte_fails_the_checksum(tmp_path):
    bf.write_block(tmp_path, 7, GEOM, payload(3))
    path = bf.block_path(tmp_path, 7)
    data = bytearray(path.read_bytes())
    data[bf.HEADER_BYTES + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(bf.BlockCorrupt, match="checksum"):
        bf.read_block(tmp_path, 7, GEOM)


@pytest.mark.parametrize("damage", ["truncate", "append", "wrong_hash", "header"])
def test_other_damage_is_corrupt_too(tmp_path, damage):
    bf.write_block(tmp_path, 9, GEOM, payload(4))
    path = bf.block_path(tmp_path, 9)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-1]
    elif damage == "append":
        data += b"x"
    elif damage == "header":
        data[0] ^= 1
    else:  # another block's file under this block's name
        bf.write_block(tmp_path, 10, GEOM, payload(4))
        data = bytearray(bf.block_path(tmp_path, 10).read_bytes())
    path.write_bytes(bytes(data))
    with pytest.raises(bf.BlockCorrupt):
        bf.read_block(tmp_path, 9, GEOM)


def test_geometry_mismatch_is_corrupt(tmp_path):
    bf.write_block(tmp_path, 11, GEOM, payload(5))
    other = BlockGeometry(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8,
                          dtype="bfloat16")
    with pytest.raises((bf.BlockCorrupt, FileNotFoundError)):
        bf.read_block(tmp_path, 11, BlockGeometry(4, 1, 4, 8, "float32"))
    with pytest.raises(bf.BlockCorrupt):
        bf.read_block(tmp_path, 11, BlockGeometry(1, 2, 4, 16, "float32"))
    assert bf.block_nbytes(other) == bf.block_nbytes(GEOM) // 2


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    real_replace = os.replace

    def full(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        bf.write_block(tmp_path, 12, GEOM, payload(6))
    monkeypatch.setattr(os, "replace", real_replace)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    with pytest.raises(FileNotFoundError):
        bf.read_block(tmp_path, 12, GEOM)


def test_scan_removes_leftover_temporaries(tmp_path):
    bf.write_block(tmp_path, 13, GEOM, payload(7))
    leftover = bf.block_path(tmp_path, 13).with_name(".x.123.tmp")
    leftover.write_bytes(b"half")
    assert [h for h, _, _ in bf.scan_blocks(tmp_path)] == [13]
    assert not leftover.exists()


def test_wrong_payload_size_is_refused(tmp_path):
    with pytest.raises(ValueError):
        bf.write_block(tmp_path, 1, GEOM, b"short")
