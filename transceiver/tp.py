"""KV between servers of different tensor-parallel sizes: which context rank sends which kv heads
(a strided part of every slot) to a generation rank, and how they are cut out and written in.

A generation rank takes each head from the first context rank holding it (`plan_parts`): whole
slots where both hold the same heads, else the sender gathers them (`gather_heads`) and the receiver
writes them among its own (`scatter_heads`), e.g. two halves merged into one slot (TP=2 -> TP=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from transceiver.wire import RankEndpoint

Heads = tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class Part:
    """One pull of a generation rank's share: from `endpoint`, the sender's heads `src` into our
    heads `dst` (both None: whole slots)."""

    endpoint: str
    src: Heads | None
    dst: Heads | None


def plan_parts(ranks: list[RankEndpoint], mine: Heads) -> list[Part]:
    """The pulls that bring heads `mine` (of the model) from the context ranks that hold them."""
    parts, head = [], mine[0]
    while head < mine[1]:
        source = next((r for r in ranks if r.kv_heads[0] <= head < r.kv_heads[1]), None)
        if source is None:
            raise ValueError(f"no context rank holds kv head {head} (ranks hold {[r.kv_heads for r in ranks]})")
        start, end = source.kv_heads
        upto = min(mine[1], end)
        whole = (start, end) == (head, upto) == mine
        parts.append(Part(source.endpoint, None if whole else (head - start, upto - start),
                          None if whole else (head - mine[0], upto - mine[0])))
        head = upto
    return parts


def unit_bytes(slot_bytes: int, kv_heads: int, heads: Heads | None) -> int:
    return slot_bytes if heads is None else slot_bytes // kv_heads * (heads[1] - heads[0])


def gather_heads(pool: torch.Tensor, slots: list[int], heads: Heads, out: torch.Tensor) -> int:
    """Copy kv heads `heads` of `slots` block by block into the front of uint8 `out`; returns the bytes."""
    pool = _elements(pool)
    idx = torch.tensor(slots, dtype=torch.long, device=pool.device)
    part = pool.index_select(0, idx)[:, :, :, :, heads[0]:heads[1]]  # [n, layers, 2, tpb, h, dim]
    nbytes = part.numel() * part.element_size()
    out[:nbytes].view(pool.dtype).view(part.shape).copy_(part)
    return nbytes


def scatter_heads(pool: torch.Tensor, slots: list[int], heads: Heads, parts: list[np.ndarray]) -> None:
    """Write a chunk's payload (blocks of `gather_heads`' layout) into kv heads `heads` of `slots`."""
    data = parts[0] if len(parts) == 1 else np.concatenate(parts)
    pool = _elements(pool)
    shape = (len(slots), *pool.shape[1:4], heads[1] - heads[0], pool.shape[5])
    src = torch.from_numpy(data).view(pool.dtype).view(shape)
    idx = torch.tensor(slots, dtype=torch.long, device=pool.device)
    pool[:, :, :, :, heads[0]:heads[1]].index_copy_(0, idx, src.to(pool.device))


def _elements(pool: torch.Tensor) -> torch.Tensor:
    """A one-byte (FP8) pool as bytes: torch has no indexed float8 copy on the CPU."""
    return pool.view(torch.uint8) if pool.element_size() == 1 else pool
