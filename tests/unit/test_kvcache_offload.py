"""Exact-state tests of host offload and onboard: ids keep, levels and slots change, bytes follow.
tpb 4, one layer; `locate` gives (level initial, slot) per block id."""

from __future__ import annotations

import pytest
from kv_factories import make_manager
from test_kvcache_support import DEVICES, PrefixBook, assert_request_kv, free_ids, locate, refs, run_prefill, write_kv

from kvcache import KVCacheError, Level, OutOfBlocksError, block_hashes


@pytest.mark.parametrize("device", DEVICES)
def test_offload_swaps_slots_and_onboard_brings_bytes_back(device):
    m = make_manager(device, host_blocks=4)
    book = PrefixBook(4)
    a = list(range(8))
    run_prefill(m, "a", a, book)
    m.release("a")
    run_prefill(m, "b", list(range(100, 116)), book)  # 4 blocks: 2 free, then a's leaf and root offloaded
    assert m.block_ids("b") == [2, 3, 4, 5]
    assert m.slot_table("b", 64) == [2, 3, 1, 0]
    assert locate(m, [0, 1]) == [("s", 1), ("s", 0)]
    assert free_ids(m, level=Level.SECONDARY) == [6, 7]
    s = m.stats()
    assert (s.evictions, s.offloads, s.bytes_offloaded) == (2, 2, 2 * m.slot_bytes(64))
    assert book.assert_cached_blocks(m) == 6
    m.release("b")
    assert m.admit("a2", a) == 7  # block 0 onboarded, 3 tokens of block 1 copied from the host pool
    # b's leaf (5 at p0) goes to the host (s2) and block 0 takes p0; then b's next leaf (4 at p1) goes
    # to s3 and the new block 7 that takes p1 receives the copy of block 1's first 3 tokens
    assert m.block_ids("a2") == [0, 7]
    assert locate(m, [0, 7, 1, 5, 4]) == [("p", 0), ("p", 1), ("s", 0), ("s", 2), ("s", 3)]
    assert_request_kv(m, "a2", a, 7)
    s = m.stats()
    assert (s.onboards, s.offloads, s.bytes_onboarded) == (1, 4, 2 * m.slot_bytes(64))
    assert book.assert_cached_blocks(m) == 6
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_low_priority_blocks_are_dropped_not_offloaded(device):
    m = make_manager(device, host_blocks=4, secondary_offload_min_priority=50)
    run_prefill(m, "lo", [1] * 4, priority=49)
    run_prefill(m, "hi", [2] * 4, priority=50)
    m.release("lo")
    m.release("hi")
    run_prefill(m, "x", list(range(16)))
    s = m.stats()
    assert (s.evictions, s.offloads) == (2, 1)
    assert m.cached_block_hashes() == block_hashes([2] * 4, 4) + block_hashes(list(range(16)), 4)
    assert locate(m, [1]) == [("s", 0)]
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_full_secondary_pool_evicts_its_lru_leaf(device):
    m = make_manager(device, primary_blocks=2, host_blocks=2)
    book = PrefixBook(4)
    for i, rid in enumerate("xyzwv"):
        toks = [i + 1] * 4
        run_prefill(m, rid, toks, book)
        m.release(rid)
    # x and y went to the host pool; z's offload needed a slot: x (LRU leaf) was dropped
    assert m.cached_block_hashes() == [h for t in (2, 3, 4, 5) for h in block_hashes([t] * 4, 4)]
    locs = {h: loc for h, loc in zip(m.cached_block_hashes(), ["s1", "s0", "p1", "p0"], strict=True)}
    assert {h: f"{lvl.name[0].lower()}{slot}" for h, (lvl, slot) in
            __import__("test_kvcache_support").tree_locations(m, 64).items()} == locs
    s = m.stats()
    assert (s.evictions, s.offloads) == (4, 3)
    assert book.assert_cached_blocks(m) == 4
    assert m.admit("y2", [2] * 4 + [0]) == 4  # y comes back from the host pool
    assert_request_kv(m, "y2", [2] * 4, 4)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_onboard_blocks_false_never_matches_host_blocks(device):
    m = make_manager(device, host_blocks=4, onboard_blocks=False)
    a = list(range(8))
    run_prefill(m, "a", a)
    m.release("a")
    run_prefill(m, "b", list(range(100, 116)))
    m.release("b")
    assert m.admit("a2", a) == 0
    assert m.stats().onboards == 0
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_ensure_primary_onboards_root_first_and_pins_hold(device):
    m = make_manager(device, host_blocks=8)
    book = PrefixBook(4)
    a = list(range(12))
    run_prefill(m, "a", a, book)
    ids = m.block_ids("a")
    m.release("a")
    run_prefill(m, "b", list(range(100, 116)), book)
    m.release("b")
    assert [lvl for lvl, _ in locate(m, ids)] == ["s", "s", "s"]
    m.ensure_primary([ids[2]])  # its secondary ancestors come first (the primary level is prefix-closed)
    assert [lvl for lvl, _ in locate(m, ids)] == ["p", "p", "p"]
    assert m.stats().onboards == 3
    slots = m.get_memory_pool_block_indices(ids)
    assert sorted(slots) == sorted(set(slots))
    assert book.assert_cached_blocks(m) == 7
    m.pin_blocks(ids, 64)
    assert refs(m) == {0: (0, 1), 1: (0, 1), 2: (0, 1)}
    with pytest.raises(OutOfBlocksError, match="needs 2 primary blocks in window 64, only 1"):
        m.admit("c", list(range(200, 208)))
    m.unpin_blocks(ids, 64)
    with pytest.raises(KVCacheError, match="unpin of block 0 "):
        m.unpin_blocks([ids[0]], 64)
    m.admit("c", list(range(200, 208)))
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_pin_blocks_onboards_and_pinned_blocks_survive_release(device):
    m = make_manager(device, host_blocks=4)
    a = list(range(8))
    run_prefill(m, "a", a)
    ids = m.block_ids("a")
    m.pin_blocks(ids, 64)  # a transfer lease on a's blocks
    m.release("a")
    assert refs(m) == {0: (0, 1), 1: (0, 1)}
    run_prefill(m, "b", list(range(100, 108)))
    with pytest.raises(OutOfBlocksError):
        m.admit("c", list(range(200, 204)))  # only pinned and in-use blocks are left
    m.unpin_blocks(ids, 64)
    m.release("b")
    run_prefill(m, "c", list(range(200, 216)))  # now a's blocks can go to the host pool
    m.release("c")
    m.pin_blocks([ids[0]], 64)  # pinning a host block onboards it first
    assert locate(m, [ids[0]])[0][0] == "p"
    assert refs(m)[ids[0]] == (0, 1)
    m.unpin_blocks([ids[0]], 64)
    m.check_integrity()


def test_a_stale_entry_in_one_level_queue_never_hides_the_live_entry_in_the_other():
    from kvcache.block_manager import BlockManager

    bm = BlockManager(2, 2, offload_min_priority=0)
    b = bm.blocks[0]
    primary, secondary, _disk = bm.queues
    primary.push(b)
    primary.push(b)  # the first entry is stale now
    secondary.push(b)  # b moved levels; with a counter per queue this entry took the stale one's seq
    assert primary.pop(lambda block: False) is None
    assert b.id in secondary.live_entries()


def test_offload_under_mixed_priorities_keeps_every_host_leaf_evictable():
    """The sequence hypothesis found (test_kvcache_stateful): a leaf offloaded while its level's
    queue still held a stale entry of it fell out of the host queue."""
    m = make_manager("cpu", primary_blocks=7, host_blocks=4, copy_on_partial_reuse=False)

    def prefill(rid, tokens, priority, extra=0):
        hit = m.admit(rid, tokens, num_tokens=len(tokens) + extra, priority=priority)
        write_kv(m, rid, tokens, hit, len(tokens))
        m.commit(rid, tokens, len(tokens))
        m.check_integrity()

    prefill("r0", [1, 2, 3, 4, 9, 0, 0, 0], 80)
    m.release("r0")
    m.ensure_primary([0], 64)
    prefill("r1", [1, 2, 3, 4, 9, 0, 0, 0], 35)
    pinned = m.block_ids("r1")
    m.pin_blocks(pinned, 64)
    m.ensure_primary([0], 64)
    m.release("r1")
    m.ensure_primary([0], 64)
    m.unpin_blocks(pinned, 64)
    prefill("r2", [7] * 9 + [0] * 7, 80)
    m.release("r2")
    m.ensure_primary([0], 64)
    prefill("r3", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], 10, extra=3)  # offloads blocks 1 and 5
    assert locate(m, [1, 5]) == [("s", 0), ("s", 1)]
    m.release("r3")
    m.check_integrity()
