"""VSWA: one block manager and pool pair per window size; early release of out-of-window blocks;
the reuse hit is the minimum over groups. tpb 4, windows 8 (sliding) and 64 (full attention)."""

from __future__ import annotations

import pytest
from kv_factories import make_manager
from test_kvcache_support import DEVICES, PrefixBook, assert_request_kv, free_ids, locate, refs, run_prefill, write_kv

from kvcache import Level

WINDOWS = (8, 64, 8, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_groups_layers_and_per_layer_views(device):
    m = make_manager(device, windows=WINDOWS, primary_blocks=8, host_blocks=2)
    assert m.window_sizes == (8, 64)
    assert (m.group_layers(8), m.group_layers(64)) == ((0, 2), (1, 3))
    assert [m.layer_window(i) for i in range(4)] == [8, 64, 8, 64]
    for w in (8, 64):
        assert m.pool(w).shape == (8, 2, 2, 4, 2, 4)
        assert m.pool(w, Level.SECONDARY).shape == (2, 2, 2, 4, 2, 4)
        assert m.num_slots(w, Level.SECONDARY) == 2
    k, v = m.layer_cache(2)  # second layer of window 8
    assert k.shape == (8, 4, 2, 4)
    assert k.data_ptr() == m.pool(8)[0, 1, 0].data_ptr() and v.data_ptr() == m.pool(8)[0, 1, 1].data_ptr()
    assert float(m.pool(8).abs().sum()) == 0.0  # zero-filled, never garbage
    with pytest.raises(ValueError, match="unknown layer 4"):
        m.layer_cache(4)


@pytest.mark.parametrize("device", DEVICES)
def test_release_out_of_window_frees_private_blocks(device):
    m = make_manager(device, windows=WINDOWS, primary_blocks=8, enable_block_reuse=False)
    toks = list(range(20))
    m.admit("r", toks, num_tokens=21)
    write_kv(m, "r", toks, 0, 20)
    assert m.block_ids("r", 8) == m.block_ids("r", 64) == [0, 1, 2, 3, 4, 5]
    assert m.release_out_of_window("r", 20) == 3  # next token 20 sees positions 13..20
    assert m.block_ids("r", 8) == [-1, -1, -1, 3, 4, 5]
    assert m.slot_table("r", 8) == [-1, -1, -1, 3, 4, 5]
    assert m.block_ids("r", 64) == [0, 1, 2, 3, 4, 5]
    assert free_ids(m, 8) == [6, 7, 0, 1, 2] and free_ids(m, 64) == [6, 7]
    assert (m.num_available_blocks(8), m.num_available_blocks(64), m.num_available_blocks()) == (5, 2, 2)
    assert m.get_memory_pool_block_indices(m.block_ids("r", 8), 8) == [-1, -1, -1, 3, 4, 5]
    m.pin_blocks(m.block_ids("r", 8), 8)  # -1 entries (released blocks) are skipped
    assert refs(m, 8) == {3: (1, 1), 4: (1, 1), 5: (1, 1)}
    m.unpin_blocks(m.block_ids("r", 8), 8)
    assert m.release_out_of_window("r", 22) == 0  # token 22 still sees position 15 (block 3)
    assert m.release_out_of_window("r", 23) == 1
    assert_request_kv(m, "r", toks, 20)  # the blocks still held are untouched
    m.release("r")
    assert free_ids(m, 8) == [6, 7, 0, 1, 2, 3, 5, 4]
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_window_cached_blocks_stay_until_the_request_ends(device):
    """With reuse, early-released blocks are in the reuse tree above blocks the request still holds;
    leaves-only eviction keeps them (prefix-closed tree) until the request releases the rest."""
    m = make_manager(device, windows=WINDOWS, primary_blocks=8)
    toks = list(range(20))
    run_prefill(m, "r", toks)
    assert m.release_out_of_window("r", 20) == 3
    assert m.num_available_blocks(8) == 3  # the free ones only
    m.release("r")
    assert m.num_available_blocks(8) == 8
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_hit_is_the_minimum_over_groups(device):
    m = make_manager(device, windows=WINDOWS, primary_blocks=6, host_blocks=2)
    book = PrefixBook(4)
    a, b = list(range(8)), list(range(100, 124))
    run_prefill(m, "a", a, book)  # priority 35: offloaded when evicted
    m.release("a")
    run_prefill(m, "b", b, book, priority=10)  # priority 10: dropped when evicted
    m.release("b")
    for w in (8, 64):
        assert locate(m, [0, 1], w) == [("s", 1), ("s", 0)]
    m.ensure_primary([0, 1], window_size=64)  # only window 64 onboards a, dropping b's last two blocks
    assert locate(m, [0, 1, 2, 3, 4, 5], 64) == [("p", 0), ("p", 1), ("p", 2), ("p", 3), ("p", 4), ("p", 5)]
    assert locate(m, [2, 3, 4, 5, 6, 7], 8) == [("p", 2), ("p", 3), ("p", 4), ("p", 5), ("p", 1), ("p", 0)]
    assert book.assert_cached_blocks(m) == 8 + 6
    b2 = b[:20] + [1000]
    assert m.admit("b2", b2) == 16  # window 8 still has 5 blocks of b2's prefix, window 64 only 4
    assert_request_kv(m, "b2", b2, 16)
    # window 8 dropped b's blocks 7 and 6; window 64 offloaded a's blocks again
    assert book.assert_cached_blocks(m) == 6 + 6
    m.check_integrity()
