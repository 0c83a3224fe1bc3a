"""How a part of a pull (transceiver/receiver/pull.py `Part`) is checked and written: a byte chunk
(`apply_chunk`: checksum, then scatter, whole slots or some kv heads), a same-GPU chunk
(`ipc_destination`: where its copy goes; the copy itself runs on the device, receiver/ipc_copies.py),
and the Cancels a failed pull sends (`cancel_targets`)."""

from __future__ import annotations

import numpy as np
import torch

from transceiver.payload import checksum, parts_are_valid, scatter
from transceiver.receiver.pull import Part, Pulling
from transceiver.stats import TransferStats
from transceiver.tp import scatter_heads, unit_bytes
from transceiver.wire import ChunkHeader, IpcChunk


def apply_chunk(part: Part, h: ChunkHeader, frames: list, pool: torch.Tensor, slot_bytes: int,
                stats: TransferStats) -> str | None:
    """Check a chunk against the part and its checksum, then write it; a problem -> sentence."""
    wanted = part.pulling.wanted
    if h.window not in wanted or h.first != part.next_first[h.window]:
        return f"unexpected chunk: window {h.window}, block {h.first}"
    first, slots = wanted[h.window]
    unit = unit_bytes(slot_bytes, pool.shape[4], part.dst) if part.dst is not None else slot_bytes
    parts = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]  # zero-copy views
    got = sum(p.size for p in parts)
    if h.count < 1 or h.first + h.count > first + len(slots) or h.nbytes != h.count * unit:
        return f"chunk header does not fit the pull: window {h.window}, blocks {h.first}+{h.count}"
    if not parts_are_valid(parts, h.count, unit):
        return f"chunk byte count mismatch: header says {h.nbytes}, received {got} in {len(parts)} frames"
    if checksum(parts, unit, h.first) != h.checksum:
        return f"chunk checksum mismatch (window {h.window}, blocks {h.first}..{h.first + h.count - 1})"
    dst = slots[h.first - first : h.first - first + h.count]
    if part.dst is None:
        scatter(pool, dst, parts)
    else:
        scatter_heads(pool, dst, part.dst, parts)
    part.next_first[h.window] = h.first + h.count
    count_written(part, h.nbytes, stats)
    return None


def ipc_destination(part: Part, h: IpcChunk, src: torch.Tensor) -> tuple[list[int], str | None]:
    """Our slots the sender's slots `h.slots` (its pool `src`, same GPU) are copied into, in order,
    or a problem; the part then expects the blocks after them."""
    wanted = part.pulling.wanted
    if h.window not in wanted or h.first != part.next_first[h.window]:
        return [], f"unexpected chunk: window {h.window}, block {h.first}"
    first, slots = wanted[h.window]
    count = len(h.slots)
    if count < 1 or h.first + count > first + len(slots) or any(not 0 <= s < src.shape[0] for s in h.slots):
        return [], f"CUDA IPC chunk does not fit the pull: window {h.window}, blocks {h.first}+{count}"
    part.next_first[h.window] = h.first + count
    return slots[h.first - first : h.first - first + count], None


def count_written(part: Part, nbytes: int, stats: TransferStats) -> None:
    part.nbytes += nbytes
    part.chunks += 1
    stats.bytes_received += nbytes


def cancel_targets(pulling: Pulling, notify: bool, failed_part: Part | None) -> list[tuple[str, int]]:
    """(endpoint, pull_id) of every Cancel a failed pull sends. One rank on each side (or not planned
    yet): today's one Cancel, unless the sender reported the failure (`notify` False). Several: one
    per part, except the part whose sender reported it (a refused duplicate must not end the lease)."""
    if not pulling.several:
        return [(pulling.endpoint, pulling.pull_id)] if notify else []
    parts = [*pulling.parts.values(), *pulling.done_parts]
    return [(p.endpoint, p.pull_id) for p in parts if notify or p is not failed_part]
