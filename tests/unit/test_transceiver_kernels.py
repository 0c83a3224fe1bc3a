"""The same-GPU handoff's fused kernels (transceiver/kernels.py) on the CPU, through Triton's
interpreter (TRITON_INTERPRET=1): per-block sums bit for bit those of the torch reference, the copied
bytes exactly the source's, every other slot untouched, and the checksum built from them equal to
the byte path's `payload.checksum`, which a single corrupted byte changes. tests/gpu/
test_transceiver_kernels_cuda.py runs the same kernels compiled, and the asynchronous handoff."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the handoff kernels need the triton package (test extra)")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CUDA machine: the kernels compile there (tests/gpu covers them)")

from transceiver import kernels as K  # noqa: E402
from transceiver.ipc import _weighted  # noqa: E402
from transceiver.payload import checksum, pool_rows  # noqa: E402

# (slot shape, dtype): 1 KiB float32 slots (128 int64 words), 2 KiB bf16 slots, 30 B slots (bytes)
SLOTS = [((2, 2, 4, 2, 8), torch.float32), ((2, 2, 4, 4, 16), torch.bfloat16), ((3, 5, 2), torch.uint8)]
SRC_SLOTS, DST_SLOTS = [7, 2, 11, 0, 5, 9], [1, 9, 3, 4, 0, 6]


def _pool(num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes seen as `dtype` (floats hold NaNs and infinities too: compared as integers)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(slot_shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_slots, nbytes), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(num_slots, *slot_shape)


def _reference_sums(rows: torch.Tensor, slots: list[int]) -> torch.Tensor:
    return rows.index_select(0, torch.tensor(slots)).sum(dim=1, dtype=torch.int64)


def _byte_checksum(pool: torch.Tensor, slots: list[int], first: int) -> int:
    rows = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()  # [num_slots, slot_bytes]
    return checksum([np.ascontiguousarray(rows[slots]).reshape(-1)], rows.shape[1], first)


@pytest.mark.parametrize("slot_shape, dtype", SLOTS)
@pytest.mark.parametrize("tile", [None, 8, 32])  # one tile per slot, or several with a ragged last one
def test_slot_sums_equal_the_torch_reference(slot_shape, dtype, tile) -> None:
    pool = _pool(12, slot_shape, dtype, seed=1)
    rows = pool_rows(pool)
    sums = K.slot_sums(rows, torch.tensor(SRC_SLOTS), tile=tile)
    assert sums.dtype == torch.int64 and torch.equal(sums, _reference_sums(rows, SRC_SLOTS))
    for first in (0, 3):
        assert int(_weighted(sums, first)) & (2**64 - 1) == _byte_checksum(pool, SRC_SLOTS, first)


@pytest.mark.parametrize("slot_shape, dtype", SLOTS)
@pytest.mark.parametrize("tile", [None, 8])
def test_copy_slot_sums_copies_exactly_and_sums_what_it_read(slot_shape, dtype, tile) -> None:
    src, dst = _pool(12, slot_shape, dtype, seed=2), _pool(10, slot_shape, dtype, seed=3)
    before = pool_rows(dst).clone()
    sums = K.copy_slot_sums(pool_rows(src), torch.tensor(SRC_SLOTS), pool_rows(dst), torch.tensor(DST_SLOTS),
                            tile=tile)
    src_rows, dst_rows = pool_rows(src), pool_rows(dst)
    assert torch.equal(sums, _reference_sums(src_rows, SRC_SLOTS))
    assert torch.equal(dst_rows[DST_SLOTS], src_rows[SRC_SLOTS])
    untouched = sorted(set(range(10)) - set(DST_SLOTS))
    assert torch.equal(dst_rows[untouched], before[untouched])
    assert int(_weighted(sums, 3)) & (2**64 - 1) == _byte_checksum(dst, DST_SLOTS, 3)


@pytest.mark.parametrize("slot_shape, dtype", SLOTS)
def test_one_corrupted_byte_changes_the_checksum(slot_shape, dtype) -> None:
    pool = _pool(12, slot_shape, dtype, seed=4)
    good = int(_weighted(K.slot_sums(pool_rows(pool), torch.tensor(SRC_SLOTS), tile=8), 0))
    raw = pool.view(12, -1).view(torch.uint8)  # the same memory, as bytes
    slot_bytes = raw.shape[1]
    for slot, offset in ((SRC_SLOTS[0], 0), (SRC_SLOTS[3], slot_bytes - 1), (SRC_SLOTS[5], slot_bytes // 2)):
        raw[slot, offset] ^= 0x10
        bad = int(_weighted(K.slot_sums(pool_rows(pool), torch.tensor(SRC_SLOTS), tile=8), 0))
        raw[slot, offset] ^= 0x10
        assert bad != good, (slot, offset)


def test_swapped_blocks_change_the_checksum() -> None:
    pool = _pool(12, *SLOTS[0], seed=5)
    rows = pool_rows(pool)
    sums = K.slot_sums(rows, torch.tensor([7, 2]))
    swapped = K.slot_sums(rows, torch.tensor([2, 7]))
    assert int(_weighted(sums, 0)) != int(_weighted(swapped, 0))


def test_copy_refuses_slots_of_other_shapes() -> None:
    src, dst = _pool(4, *SLOTS[0], seed=6), _pool(4, *SLOTS[2], seed=7)
    with pytest.raises(ValueError, match="slots differ"):
        K.copy_slot_sums(pool_rows(src), torch.tensor([0]), pool_rows(dst), torch.tensor([0]))


def test_an_empty_chunk_sums_to_nothing() -> None:
    rows = pool_rows(_pool(4, *SLOTS[0], seed=8))
    assert K.slot_sums(rows, torch.tensor([], dtype=torch.long)).shape == (0,)
