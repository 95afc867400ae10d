"""Pool geometry: validate regions, copy blocks, address bytes as rows.

A pool `(2, L, H, NB, bs, D)` is viewed two ways:

    blocks  (2, L, H, NB, E)       E = bs * D; one block of one (kv, layer, head)
    rows    (2 * L * H * NB, E)    row ((k * L + l) * H + h) * NB + b

*Canonical order* of a region (ids, [l0, l1)) is rows ordered
(k, l, h, j) for k in 0..1, l in l0..l1-1, h in 0..H-1, j over ids. It is the
order bytes travel in on tcp and ring, and the order checksums read them, so
a checksum of the source region equals that of the destination region iff
the transfer was byte-identical.

Same-node copies (`copy_blocks`) do not go row by row: a run of block ids
that is consecutive on both sides is one strided slice copy of the blocks
view (one torch op per run, across all K/V, layers and heads), which torch
does at memcpy speed and without the GIL. Scattered ids go through
index_select/index_copy_ instead of a Python loop per block.
"""

from __future__ import annotations

import zlib

import torch

from deepserve.transfer.types import PoolRegion, TransferError

MAX_SLICE_RUNS = 64  # more runs than this (and short ones): use index ops
CHECKSUM_CHUNK_BYTES = 16 << 20


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {name!r}")
    return dtype


def check_pool(pool: torch.Tensor) -> None:
    if pool.dim() != 6 or pool.shape[0] != 2 or not pool.is_contiguous():
        raise ValueError(f"a KV pool is a contiguous (2, L, H, NB, bs, D) tensor, "
                         f"got shape {tuple(pool.shape)} contiguous={pool.is_contiguous()}")


def check_compatible(ours: tuple[int, ...], our_dtype: str, theirs: tuple[int, ...],
                     their_dtype: str) -> None:
    """Pools can exchange blocks iff they agree on dtype and every dim but NB."""
    same = len(ours) == len(theirs) == 6 and all(
        a == b for i, (a, b) in enumerate(zip(ours, theirs)) if i != 3)
    if not same or our_dtype != their_dtype:
        raise TransferError(f"peer pool {tuple(theirs)} {their_dtype} does not match ours "
                            f"{tuple(ours)} {our_dtype} (only NB may differ)")


def layer_range(region: PoolRegion, num_layers: int) -> tuple[int, int]:
    l0, l1 = region.layers if region.layers is not None else (0, num_layers)
    if not 0 <= l0 < l1 <= num_layers:
        raise TransferError(f"layer range [{l0}, {l1}) outside [0, {num_layers})")
    return l0, l1


def check_ids(ids: list[int], num_blocks: int, side: str, unique: bool = False) -> None:
    for b in ids:
        if not 0 <= b < num_blocks:
            raise TransferError(f"{side} block id {b} out of range [0, {num_blocks})")
    if unique and len(set(ids)) != len(ids):
        raise TransferError(f"{side} block ids repeat: {ids}")


def check_pair(src: PoolRegion, dst: PoolRegion, src_shape: tuple[int, ...],
               dst_shape: tuple[int, ...]) -> tuple[int, int]:
    """Validate a (src, dst) pair of regions; the layer range they share."""
    if len(src.block_ids) != len(dst.block_ids):
        raise TransferError(f"{len(src.block_ids)} source blocks but "
                            f"{len(dst.block_ids)} destination blocks")
    layers = layer_range(src, src_shape[1])
    if layer_range(dst, dst_shape[1]) != layers:
        raise TransferError(f"layer ranges differ: src {src.layers} dst {dst.layers}")
    check_ids(src.block_ids, src_shape[3], "source")
    check_ids(dst.block_ids, dst_shape[3], "destination", unique=True)
    return layers


def region_nbytes(shape: tuple[int, ...], itemsize: int, num_ids: int,
                  layers: tuple[int, int]) -> int:
    _, _, h, _, bs, d = shape
    return 2 * (layers[1] - layers[0]) * h * num_ids * bs * d * itemsize


def blocks_view(pool: torch.Tensor) -> torch.Tensor:
    two, l, h, nb, bs, d = pool.shape
    return pool.view(two, l, h, nb, bs * d)  # (2, L, H, NB, E)


def rows_view(pool: torch.Tensor) -> torch.Tensor:
    two, l, h, nb, bs, d = pool.shape
    return pool.view(two * l * h * nb, bs * d)  # (R, E)


def row_index(shape: tuple[int, ...], ids: list[int], layers: tuple[int, int]) -> torch.Tensor:
    """Pool row of every canonical row of the region, as int64 (num_rows,)."""
    _, num_layers, h, nb, _, _ = shape
    k = torch.arange(2).view(2, 1, 1, 1)
    lay = torch.arange(*layers).view(1, -1, 1, 1)
    head = torch.arange(h).view(1, 1, h, 1)
    base = ((k * num_layers + lay) * h + head) * nb  # (2, nl, H, 1)
    return (base + torch.tensor(ids, dtype=torch.int64).view(1, 1, 1, -1)).reshape(-1)


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(s0, d0, n) runs where both id lists advance by one together."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            s0, d0, n = out[-1]
            out[-1] = (s0, d0, n + 1)
        else:
            out.append((s, d, 1))
    return out


def _few_runs(num_runs: int, num_items: int) -> bool:
    return num_runs <= MAX_SLICE_RUNS or num_runs * 8 <= num_items


def copy_blocks(src_pool: torch.Tensor, src_ids: list[int], dst_pool: torch.Tensor,
                dst_ids: list[int], layers: tuple[int, int]) -> None:
    """dst_pool[:, layers, :, dst_ids] = src_pool[:, layers, :, src_ids] (validated ids)."""
    src, dst = blocks_view(src_pool), blocks_view(dst_pool)
    l0, l1 = layers
    if l1 - l0 == src.shape[1]:  # all layers: merge (kv, layer) into one dim
        src, dst = src.flatten(0, 1), dst.flatten(0, 1)  # (2L, H, NB, E)
    else:
        src, dst = src[:, l0:l1], dst[:, l0:l1]  # (2, nl, H, NB, E) strided
    block_runs = runs(src_ids, dst_ids)
    if _few_runs(len(block_runs), len(src_ids)):
        for s0, d0, n in block_runs:  # one strided copy per run
            dst[..., d0:d0 + n, :].copy_(src[..., s0:s0 + n, :])
        return
    sidx = torch.tensor(src_ids, dtype=torch.int64)
    didx = torch.tensor(dst_ids, dtype=torch.int64)
    dim = src.dim() - 2
    dst.index_copy_(dim, didx, src.index_select(dim, sidx))


def _row_runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(position, first row, length) of each consecutive stretch of idx."""
    if idx.numel() == 0:
        return []
    breaks = (torch.nonzero(idx[1:] - idx[:-1] != 1).view(-1) + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, idx.numel()]
    firsts = idx[starts].tolist()
    return [(p, r, e - p) for p, r, e in zip(starts, firsts, ends)]


def gather_rows(rows: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = rows[idx[i]]; out is (len(idx), E)."""
    stretches = _row_runs(idx)
    if _few_runs(len(stretches), idx.numel()):
        for p, r, n in stretches:
            out[p:p + n].copy_(rows[r:r + n])
    else:
        torch.index_select(rows, 0, idx, out=out)


def scatter_rows(rows: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """rows[idx[i]] = src[i]; src is (len(idx), E)."""
    stretches = _row_runs(idx)
    if _few_runs(len(stretches), idx.numel()):
        for p, r, n in stretches:
            rows[r:r + n].copy_(src[p:p + n])
    else:
        rows.index_copy_(0, idx, src)


def as_bytes(t: torch.Tensor):
    """A contiguous tensor's bytes as a flat uint8 numpy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def checksum_rows(rows: torch.Tensor, idx: torch.Tensor) -> int:
    """crc32 of rows[idx] in order, gathered a bounded chunk at a time."""
    per_chunk = max(1, CHECKSUM_CHUNK_BYTES // (rows.shape[1] * rows.element_size()))
    buf = torch.empty((min(per_chunk, idx.numel()), rows.shape[1]), dtype=rows.dtype)
    crc = 0
    for i in range(0, idx.numel(), per_chunk):
        part = idx[i:i + per_chunk]
        out = buf[:part.numel()]
        gather_rows(rows, part, out)
        crc = zlib.crc32(as_bytes(out), crc)
    return crc


def checksum_region(pool: torch.Tensor, ids: list[int], layers: tuple[int, int]) -> int:
    return checksum_rows(rows_view(pool), row_index(tuple(pool.shape), ids, layers))
