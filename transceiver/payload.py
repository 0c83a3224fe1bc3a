"""KV payload mechanics: chunk plans, checksums, staging buffers, gather from and scatter into a pool.

A pool is the slot-major tensor `[num_slots, layers, 2, tokens_per_block, kv_heads, head_dim]`, here
only ever seen as rows of words (`kvcache.pool.pool_rows`), so gather/scatter move whole slots.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import zmq

from kvcache.pool import pool_rows, slot_runs
from transceiver.wire import WindowRange

POLL_S = 0.0005  # how often `StagingPool.wait_any` looks at the trackers


def plan_chunks(r: WindowRange, slot_bytes: int, max_chunk_bytes: int) -> list[WindowRange]:
    """The chunks of `r`: each as many whole blocks as fit in max_chunk_bytes (at least one)."""
    return r.split(max(1, max_chunk_bytes // slot_bytes))


def frame_bounds(nbytes: int, max_chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of a chunk's payload frames (one frame unless one block is huge)."""
    return [(s, min(nbytes, s + max_chunk_bytes)) for s in range(0, nbytes, max_chunk_bytes)]


def _words(part: np.ndarray, slot_bytes: int) -> np.ndarray:
    return part.view(np.uint64) if slot_bytes % 8 == 0 else part


def checksum(parts: list[np.ndarray], slot_bytes: int, first: int) -> int:
    """sum_b (2 * (first + b) + 1) * S_b mod 2**64, S_b the wrapping sum of block b's 64-bit words
    (bytes when slot_bytes % 8) over a chunk's frames (`parts_are_valid`); the weights catch a
    swapped or misplaced block."""
    if whole_blocks(parts, slot_bytes):
        sums = np.concatenate([  # [count]
            _words(p, slot_bytes).reshape(p.size // slot_bytes, -1).sum(axis=1, dtype=np.uint64) for p in parts])
    else:
        total = sum(int(_words(p, slot_bytes).sum(dtype=np.uint64)) for p in parts) % 2**64
        sums = np.array([total], dtype=np.uint64)
    weights = 2 * (np.arange(sums.size, dtype=np.uint64) + np.uint64(first)) + np.uint64(1)
    return int((sums * weights).sum(dtype=np.uint64))


def whole_blocks(parts: list[np.ndarray], slot_bytes: int) -> bool:
    return all(p.size % slot_bytes == 0 and p.size > 0 for p in parts)


def parts_are_valid(parts: list[np.ndarray], count: int, slot_bytes: int) -> bool:
    """The payload layouts a chunk may have: `count` blocks in parts of whole blocks, or one block
    cut in several non-empty parts."""
    if not parts or sum(p.size for p in parts) != count * slot_bytes:
        return False
    return whole_blocks(parts, slot_bytes) or (count == 1 and all(p.size > 0 for p in parts))


def as_rows(buf: torch.Tensor, count: int, slot_bytes: int) -> torch.Tensor:
    """The first count * slot_bytes bytes of uint8 `buf` as `[count, words]` like `pool_rows`."""
    rows = buf[: count * slot_bytes].view(count, slot_bytes)
    return rows.view(torch.int64) if slot_bytes % 8 == 0 else rows


def gather(pool: torch.Tensor, slots: list[int], out: torch.Tensor) -> None:
    """Copy `slots` of `pool` in order into the front of uint8 CPU buffer `out`. CPU pools: a numpy
    slice copy per run on this thread (2 busy cores: 10-14 GB/s, np.take 4, torch's multi-threaded
    copies as low as 0.2, stalled by the zmq threads)."""
    src = pool_rows(pool)
    dst = as_rows(out, len(slots), src.shape[1] * src.element_size())
    if pool.device.type == "cpu":
        src_np, dst_np = src.numpy(), dst.numpy()
        for i, first, n in slot_runs(slots):
            dst_np[i : i + n] = src_np[first : first + n]
    else:
        dst.copy_(src.index_select(0, torch.tensor(slots, dtype=torch.long, device=pool.device)))


def scatter(pool: torch.Tensor, slots: list[int], parts: list[np.ndarray]) -> None:
    """Write a chunk's payload (`parts`, see `checksum`) into slots `slots` of `pool`, in order."""
    rows = pool_rows(pool)
    slot_bytes = rows.shape[1] * rows.element_size()
    if whole_blocks(parts, slot_bytes):
        done = 0
        for part in parts:
            n = part.size // slot_bytes
            _write_rows(rows, slots[done : done + n], as_rows(torch.from_numpy(part), n, slot_bytes))
            done += n
        return
    row = pool.view(pool.shape[0], -1).view(torch.uint8)[slots[0]]  # [slot_bytes], one huge block
    offset = 0
    for part in parts:
        row[offset : offset + part.size].copy_(torch.from_numpy(part))
        offset += part.size


def _write_rows(rows: torch.Tensor, slots: list[int], src: torch.Tensor) -> None:
    """rows[slots[i]] = src[i] (`src` on the CPU)."""
    if rows.device.type == "cpu":  # see `gather`
        rows_np, src_np = rows.numpy(), src.numpy()
        for i, first, n in slot_runs(slots):
            rows_np[first : first + n] = src_np[i : i + n]
    else:
        rows.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=rows.device), src.to(rows.device))


def pool_views(pool: torch.Tensor, slots: list[int]) -> list[np.ndarray]:
    """uint8 views of a CPU pool's slots, one per run of consecutive slots (no copy)."""
    rows = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()  # [num_slots, slot_bytes]
    return [rows[first : first + n].reshape(-1) for _, first, n in slot_runs(slots)]


def wait_any(trackers: list[zmq.MessageTracker], timeout_s: float) -> None:
    """Wait (at most timeout_s) until one of `trackers` is done (returns at once if none is busy)."""
    deadline = time.monotonic() + timeout_s
    while trackers and all(not t.done for t in trackers) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def tracked_frames(views: list[np.ndarray]) -> tuple[list[zmq.Frame], zmq.MessageTracker]:
    """Zero-copy frames over `views`; the tracker is done once zmq has released all of them."""
    frames = [zmq.Frame(v, copy=False, track=True) for v in views]
    return frames, zmq.MessageTracker(*frames)


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

    def frames(self, i: int, bounds: list[tuple[int, int]]) -> tuple[list[zmq.Frame], zmq.MessageTracker]:
        """Zero-copy frames over byte ranges of buffer i; the buffer stays busy until they are sent."""
        frames, tracker = tracked_frames(self.parts(i, bounds))
        self._trackers[i] = tracker
        return frames, tracker

    def parts(self, i: int, bounds: list[tuple[int, int]]) -> list[np.ndarray]:
        arr = self.buffer(i).numpy()
        return [arr[s:e] for s, e in bounds]
