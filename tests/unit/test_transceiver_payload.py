"""Chunk plans, checksums, gather/scatter through staging buffers, staging reuse after zmq releases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from transceiver.payload import (
    StagingPool,
    checksum,
    frame_bounds,
    gather,
    plan_chunks,
    scatter,
    slot_runs,
    wait_any,
)
from transceiver.wire import WindowRange


def test_plan_chunks_packs_whole_blocks() -> None:
    assert plan_chunks(WindowRange(64, 3, 7), 1000, 3000) == [
        WindowRange(64, 3, 3), WindowRange(64, 6, 3), WindowRange(64, 9, 1)]
    assert plan_chunks(WindowRange(64, 0, 2), 5000, 3000) == [WindowRange(64, 0, 1), WindowRange(64, 1, 1)]
    assert plan_chunks(WindowRange(64, 4, 0), 1000, 3000) == []
    assert frame_bounds(3000, 3000) == [(0, 3000)]
    assert frame_bounds(5000, 3000) == [(0, 3000), (3000, 5000)]


def _blocks(n: int, slot_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n * slot_bytes, dtype=np.uint8)


@pytest.mark.parametrize("slot_bytes", [64, 60])  # words, and bytes when slot_bytes % 8
def test_checksum_sees_swaps_flips_and_position(slot_bytes: int) -> None:
    data = _blocks(4, slot_bytes)
    base = checksum([data], slot_bytes, first=5)
    swapped = np.concatenate([data[slot_bytes : 2 * slot_bytes], data[:slot_bytes], data[2 * slot_bytes :]])
    assert checksum([swapped], slot_bytes, first=5) != base
    flipped = data.copy()
    flipped[7] ^= 0x10
    assert checksum([flipped], slot_bytes, first=5) != base
    assert checksum([data], slot_bytes, first=6) != base  # same bytes, other block indices
    assert checksum([data.copy()], slot_bytes, first=5) == base


def test_checksum_of_one_block_split_in_frames_equals_unsplit() -> None:
    block = _blocks(1, 4096)
    assert checksum([block[:1024], block[1024:3072], block[3072:]], 4096, 9) == checksum([block], 4096, 9)


def test_checksum_wraps_at_64_bits() -> None:
    ones = np.full(16, 0xFF, dtype=np.uint8)  # two words of 2**64 - 1
    assert checksum([ones], 16, first=0) == (2 * (2**64 - 1)) % 2**64


def _pool(num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, 2, 2, 4, 2, 8, generator=g).to(torch.bfloat16)  # slot = 512 B


def test_gather_then_scatter_moves_exact_slots() -> None:
    src, dst = _pool(16, 1), torch.zeros(16, 2, 2, 4, 2, 8, dtype=torch.bfloat16)
    src_slots, dst_slots = [9, 2, 14, 0], [3, 15, 4, 7]
    staging = StagingPool(8192, 1, pin=False)
    i = staging.acquire()
    gather(src, src_slots, staging.buffer(i))
    parts = staging.parts(i, [(0, 4 * 512)])
    scatter(dst, dst_slots, parts)
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert torch.equal(dst[d], src[s])
    untouched = [k for k in range(16) if k not in dst_slots]
    assert torch.count_nonzero(dst[untouched]) == 0


def test_scatter_of_one_block_split_in_frames() -> None:
    src, dst = _pool(4, 2), torch.zeros(4, 2, 2, 4, 2, 8, dtype=torch.bfloat16)
    staging = StagingPool(512, 1, pin=False)
    i = staging.acquire()
    gather(src, [3], staging.buffer(i))
    parts = staging.parts(i, frame_bounds(512, 128))
    assert len(parts) == 4
    scatter(dst, [1], parts)
    assert torch.equal(dst[1], src[3]) and torch.count_nonzero(dst[[0, 2, 3]]) == 0


def test_staging_buffer_is_reused_only_after_zmq_released_its_frames() -> None:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://staging-test")
        b.connect("inproc://staging-test")
        pool = StagingPool(1 << 17, 2, pin=False)
        first = pool.acquire()
        pool.buffer(first).fill_(7)
        frames, tracker = pool.frames(first, [(0, 1 << 17)])
        second = pool.acquire()
        assert (first, second) == (0, 1)  # buffer 0 is held by its frames
        held, held_tracker = pool.frames(second, [(0, 1 << 16)])  # buffer 1 busy too
        assert pool.acquire() is None
        a.send_multipart(frames, copy=False)
        del frames
        got = b.recv(copy=False)  # inproc hands over the very same memory
        assert bytes(got.buffer[:4]) == b"\x07" * 4
        assert pool.acquire() is None
        del got
        wait_any([tracker], 5.0)
        assert tracker.done and pool.acquire() == 0
        busy_again, again = pool.frames(0, [(0, 1 << 16)])
        assert pool.acquire() is None
        del held  # frames dropped unsent release their buffer as well
        wait_any([held_tracker], 5.0)
        assert pool.acquire() == 1
        del busy_again
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_slot_runs_coalesce_consecutive_slots() -> None:
    assert slot_runs([4, 5, 6, 9, 2, 3, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2), (6, 3, 1)]
    assert slot_runs([]) == []
