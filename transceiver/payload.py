"""KV payload mechanics: chunk plans, checksums, staging buffers, gather from and scatter into a pool.

A pool is the slot-major tensor `[num_slots, layers, 2, tokens_per_block, kv_heads, head_dim]`
(contiguous, one slot = `slot_bytes`). Here it is only ever seen as rows of words:
`pool_rows(pool)` -> `[num_slots, slot_bytes // 8]` int64 (or uint8 rows when slot_bytes % 8),
so gather/scatter move whole slots with one `index_select`/`index_copy_`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

POLL_S = 0.0005  # how often `StagingPool.wait_any` looks at the trackers


@dataclass(frozen=True)
class ChunkPlan:
    """Blocks [first, first + count) of one window's block list, sent as one chunk message."""

    window: int
    first: int
    count: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return self.count * self.slot_bytes


def plan_chunks(window: int, first: int, count: int, slot_bytes: int,
                max_chunk_bytes: int) -> list[ChunkPlan]:
    """Whole blocks per chunk, as many as fit in max_chunk_bytes (at least one)."""
    per_chunk = max(1, max_chunk_bytes // slot_bytes)
    return [
        ChunkPlan(window, start, min(per_chunk, first + count - start), slot_bytes)
        for start in range(first, first + count, per_chunk)
    ]


def frame_bounds(nbytes: int, max_chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of a chunk's payload frames (one frame unless one block is huge)."""
    return [(s, min(nbytes, s + max_chunk_bytes)) for s in range(0, nbytes, max_chunk_bytes)]


def _words(part: np.ndarray, slot_bytes: int) -> np.ndarray:
    return part.view(np.uint64) if slot_bytes % 8 == 0 else part


def checksum(parts: list[np.ndarray], slot_bytes: int, first: int) -> int:
    """Position-weighted wrapping sum: sum_b (2 * (first + b) + 1) * S_b mod 2**64.

    S_b is the wrapping sum of block b's 64-bit words (its bytes when slot_bytes % 8). `parts`
    are the chunk's uint8 frames in order: several whole blocks in one part, or one block in
    several parts. The weights make a swapped or misplaced block change the result.
    """
    if len(parts) == 1:
        arr = parts[0]
        count = arr.size // slot_bytes
        sums = _words(arr, slot_bytes).reshape(count, -1).sum(axis=1, dtype=np.uint64)  # [count]
    else:
        total = sum(int(_words(p, slot_bytes).sum(dtype=np.uint64)) for p in parts) % 2**64
        sums = np.array([total], dtype=np.uint64)
    weights = 2 * (np.arange(sums.size, dtype=np.uint64) + np.uint64(first)) + np.uint64(1)
    return int((sums * weights).sum(dtype=np.uint64))


def pool_rows(pool: torch.Tensor) -> torch.Tensor:
    """`pool` seen as `[num_slots, words]` (int64 words, or bytes when slot_bytes % 8)."""
    rows = pool.view(pool.shape[0], -1).view(torch.uint8)  # [num_slots, slot_bytes]
    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 else rows


def as_rows(buf: torch.Tensor, count: int, slot_bytes: int) -> torch.Tensor:
    """The first count * slot_bytes bytes of uint8 `buf` as `[count, words]` like `pool_rows`."""
    rows = buf[: count * slot_bytes].view(count, slot_bytes)
    return rows.view(torch.int64) if slot_bytes % 8 == 0 else rows


def gather(pool: torch.Tensor, slots: list[int], out: torch.Tensor) -> None:
    """Copy primary slots `slots` of `pool`, in order, into the front of uint8 CPU buffer `out`.

    CPU pools are copied with numpy on the calling thread only: torch's multi-threaded copies
    stall badly when the zmq threads compete for the same cores (measured 0.3 vs 10 GB/s)."""
    src = pool_rows(pool)
    dst = as_rows(out, len(slots), src.shape[1] * src.element_size())
    if pool.device.type == "cpu":
        np.take(src.numpy(), np.asarray(slots, dtype=np.int64), axis=0, out=dst.numpy())
    else:
        dst.copy_(src.index_select(0, torch.tensor(slots, dtype=torch.long, device=pool.device)))


def scatter(pool: torch.Tensor, slots: list[int], parts: list[np.ndarray]) -> None:
    """Write a chunk's payload (`parts`, see `checksum`) into slots `slots` of `pool`, in order."""
    rows = pool_rows(pool)
    slot_bytes = rows.shape[1] * rows.element_size()
    if len(parts) == 1:
        src = as_rows(torch.from_numpy(parts[0]), len(slots), slot_bytes)
        if pool.device.type == "cpu":  # single-threaded, see `gather`
            rows.numpy()[np.asarray(slots, dtype=np.int64)] = src.numpy()
        else:
            rows.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=pool.device), src.to(pool.device))
        return
    row = pool.view(pool.shape[0], -1).view(torch.uint8)[slots[0]]  # [slot_bytes], one huge block
    offset = 0
    for part in parts:
        row[offset : offset + part.size].copy_(torch.from_numpy(part))
        offset += part.size


class StagingPool:
    """A few reusable CPU byte buffers for outgoing chunks; a buffer is free again once zmq has
    released every frame made from it (tracked), so it is never overwritten while on the wire."""

    def __init__(self, nbytes: int, count: int, pin: bool) -> None:
        self._nbytes = nbytes
        self._pin = pin
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._trackers: list[zmq.MessageTracker | None] = [None] * count

    def acquire(self) -> int | None:
        """Index of a free buffer, or None when all are still held by zmq."""
        for i, tracker in enumerate(self._trackers):
            if tracker is None or tracker.done:
                self._trackers[i] = None
                if self._buffers[i] is None:
                    self._buffers[i] = torch.empty(self._nbytes, dtype=torch.uint8, pin_memory=self._pin)
                return i
        return None

    def buffer(self, i: int) -> torch.Tensor:
        buf = self._buffers[i]
        assert buf is not None, "acquire() first"
        return buf

    def frames(self, i: int, bounds: list[tuple[int, int]]) -> list[zmq.Frame]:
        """Zero-copy frames over byte ranges of buffer i; the buffer stays busy until they are sent."""
        view = memoryview(self.buffer(i).numpy())
        frames = [zmq.Frame(view[s:e], copy=False, track=True) for s, e in bounds]
        self._trackers[i] = zmq.MessageTracker(*frames)
        return frames

    def wait_any(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) until some buffer is free."""
        deadline = time.monotonic() + timeout_s
        while all(t is not None and not t.done for t in self._trackers) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def parts(self, i: int, bounds: list[tuple[int, int]]) -> list[np.ndarray]:
        arr = self.buffer(i).numpy()
        return [arr[s:e] for s, e in bounds]
