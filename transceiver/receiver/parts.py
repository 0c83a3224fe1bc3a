"""A pull as the generation side's engine thread tracks it: the request (`Pulling`) and its parts,
one per context rank it comes from (`Part`), and how a part's chunks are checked and written.

Without tensor parallelism a request has one part: whole slots from its context server. Otherwise
each part brings some kv heads of every block (`src` of the sender's, written into our `dst`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvcache import KVCacheManager, Level
from transceiver.ipc import copy_slots
from transceiver.payload import checksum, parts_are_valid, scatter
from transceiver.stats import TransferStats
from transceiver.tp import Heads, scatter_heads, unit_bytes
from transceiver.wire import ChunkHeader, IpcChunk

Wanted = dict[int, tuple[int, list[int]]]  # window -> (first block index, destination slots)


@dataclass
class Pulling:
    """One request's pull (the caller's unit: one `PullResult`)."""

    request_id: str
    pull_id: int  # its first part's id; also the id the link plans it under
    endpoint: str  # the context server's (its rank 0's)
    ctx_epoch: str
    ctx_request_id: str
    wanted: Wanted
    started: float  # monotonic
    deadline: float
    parts: dict[int, Part] = field(default_factory=dict)  # running parts by pull_id (empty until planned)
    done_parts: list[Part] = field(default_factory=list)
    planned: bool = False
    several: bool = False  # several ranks on a side: the lease ends with Release, not with an Ack

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in [*self.parts.values(), *self.done_parts])


@dataclass
class Part:
    """What one context rank sends of the request: every block of `wanted`, whole or some heads."""

    pulling: Pulling
    pull_id: int
    endpoint: str
    src: Heads | None  # the sender's kv heads (None: whole slots)
    dst: Heads | None  # ours they go into
    next_first: dict[int, int] = field(default_factory=dict)  # window -> next block index expected
    nbytes: int = 0
    chunks: int = 0
    via_ipc: bool = False  # chunks came as CUDA IPC copies
    first_at: float | None = None  # when the socket thread received its first answer
    apply_s: float = 0.0  # engine thread: checking and writing chunks

    def __post_init__(self) -> None:
        self.next_first = {w: first for w, (first, _) in self.pulling.wanted.items()}

    def missing(self) -> list[int]:
        return [w for w, (first, slots) in self.pulling.wanted.items() if self.next_first[w] != first + len(slots)]


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
    _advance(part, h.window, h.first + h.count, h.nbytes, stats)
    return None


def apply_ipc_chunk(part: Part, h: IpcChunk, src: torch.Tensor, pool: torch.Tensor, slot_bytes: int,
                    stats: TransferStats) -> str | None:
    """Copy the sender's slots `h.slots` (its pool `src`, same GPU) into ours and check what was written."""
    wanted = part.pulling.wanted
    if h.window not in wanted or h.first != part.next_first[h.window]:
        return f"unexpected chunk: window {h.window}, block {h.first}"
    first, slots = wanted[h.window]
    count = len(h.slots)
    if count < 1 or h.first + count > first + len(slots) or any(not 0 <= s < src.shape[0] for s in h.slots):
        return f"CUDA IPC chunk does not fit the pull: window {h.window}, blocks {h.first}+{count}"
    dst = slots[h.first - first : h.first - first + count]
    written = copy_slots(src, h.slots, pool, dst, h.first)
    if written != h.checksum:
        return f"chunk checksum mismatch after the CUDA IPC copy (window {h.window}, " \
               f"blocks {h.first}..{h.first + count - 1})"
    _advance(part, h.window, h.first + count, count * slot_bytes, stats)
    part.via_ipc = True
    return None


def _advance(part: Part, window: int, next_first: int, nbytes: int, stats: TransferStats) -> None:
    part.next_first[window] = next_first
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


def check_wanted(kv: KVCacheManager, wanted: Wanted) -> None:
    for window, (first, slots) in wanted.items():
        if window not in kv.window_sizes:
            raise ValueError(f"unknown window {window}; valid: {sorted(kv.window_sizes)}")
        num_slots = kv.pool(window, Level.PRIMARY).shape[0]
        if first < 0 or any(not 0 <= s < num_slots for s in slots):
            raise ValueError(f"window {window}: bad first block {first} or slots outside [0, {num_slots})")
