"""Fused Triton kernels of the same-GPU KV handoff (ipc.py), each reading the slots once: the
sender's checksum (`slot_sums`) and the receiver's copy that sums as it writes (`copy_slot_sums`).

Both return S_b, block b's wrapping word sum (`payload.checksum` weights it); program (b, t) sums
tile t and torch adds the tiles: associative wrapping addition equals the torch reference bit for
bit. Imported only for CUDA pools: the router and CPU paths never import triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # words per program: 32 KiB of int64 words
MAX_TILES = 65535  # the grid's second dimension


@triton.jit
def _slot_sums(SRC, SRC_SLOTS, DST, DST_SLOTS, PARTIALS, words, n_tiles, TILE: tl.constexpr, COPY: tl.constexpr):
    """Program (b, t): words [t * TILE, (t + 1) * TILE) of slot SRC_SLOTS[b]; with COPY, also
    written to the same words of slot DST_SLOTS[b] of DST."""
    b, t = tl.program_id(0), tl.program_id(1)
    offs = t * TILE + tl.arange(0, TILE)
    live = offs < words
    src = tl.load(SRC_SLOTS + b).to(tl.int64)  # slot * words exceeds int32 in big pools
    x = tl.load(SRC + src * words + offs, mask=live, other=0)
    if COPY:
        dst = tl.load(DST_SLOTS + b).to(tl.int64)
        tl.store(DST + dst * words + offs, x, mask=live)
    tl.store(PARTIALS + b * n_tiles + t, tl.sum(x.to(tl.int64), axis=0))  # uint8 words widen unsigned


def _launch(src_rows: torch.Tensor, src_index: torch.Tensor, dst_rows: torch.Tensor | None,
            dst_index: torch.Tensor | None, tile: int | None) -> torch.Tensor:
    count, words = src_index.numel(), src_rows.shape[1]
    size = tile if tile is not None else max(TILE, triton.next_power_of_2(triton.cdiv(words, MAX_TILES)))
    n_tiles = triton.cdiv(words, size)
    partials = torch.empty((count, n_tiles), dtype=torch.int64, device=src_rows.device)  # [blocks, tiles]
    if count:
        copy = dst_rows is not None
        _slot_sums[(count, n_tiles)](src_rows, src_index, dst_rows if copy else src_rows,
                                     dst_index if copy else src_index, partials, words, n_tiles,
                                     TILE=size, COPY=copy)
    return partials.sum(dim=1, dtype=torch.int64)  # [blocks]


def slot_sums(rows: torch.Tensor, index: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """S_b of rows[index[b]] for every b -> int64 `[len(index)]`. `rows` `[num_slots, words]`
    (contiguous), `index` int64 on the same device."""
    return _launch(rows, index, None, None, tile)


def copy_slot_sums(src_rows: torch.Tensor, src_index: torch.Tensor, dst_rows: torch.Tensor,
                   dst_index: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """dst_rows[dst_index[b]] = src_rows[src_index[b]] and S_b of the words read -> int64 `[len]`.
    Both row tensors `[slots, words]` of one word type, contiguous, on one device."""
    if src_rows.dtype != dst_rows.dtype or src_rows.shape[1] != dst_rows.shape[1]:
        raise ValueError(f"slots differ: {src_rows.dtype} x {src_rows.shape[1]} vs {dst_rows.dtype} x "
                         f"{dst_rows.shape[1]}")
    return _launch(src_rows, src_index, dst_rows, dst_index, tile)
