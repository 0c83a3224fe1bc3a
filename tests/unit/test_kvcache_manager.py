"""Exact-state tests of the KV cache manager without offload: block ids, ref counts, free order,
reuse and eviction order after each step. tpb 4, 4 primary blocks unless stated."""

from __future__ import annotations

import pytest
from kv_factories import make_manager
from test_kvcache_support import DEVICES, PrefixBook, assert_request_kv, free_ids, refs, run_prefill, write_kv

from kvcache import block_hashes


@pytest.mark.parametrize("device", DEVICES)
def test_allocate_commit_release_free_order(device):
    m = make_manager(device)
    assert free_ids(m) == [0, 1, 2, 3]
    a = list(range(10))
    assert run_prefill(m, "a", a) == 0
    assert m.block_ids("a") == [0, 1, 2] and m.slot_table("a", 64) == [0, 1, 2]
    assert refs(m) == {0: (1, 0), 1: (1, 0), 2: (1, 0)}
    assert free_ids(m) == [3]
    assert m.cached_block_hashes() == block_hashes(a, 4)  # the two full blocks
    m.release("a")
    assert refs(m) == {} and free_ids(m) == [3, 2]  # the partial block 2 is freed, 0 and 1 stay cached
    blocks = m.stats().blocks
    assert (blocks[64, "primary", "free"], blocks[64, "primary", "cached"], blocks[64, "primary", "in_use"]) \
        == (2, 2, 0)
    assert m.num_available_blocks() == 4
    assert run_prefill(m, "b", list(range(100, 108))) == 0
    assert m.block_ids("b") == [3, 2]
    assert run_prefill(m, "c", [7, 7, 7, 7]) == 0  # no free block: evicts a's leaf, block 1
    assert m.block_ids("c") == [1]
    assert m.stats().evictions == 1
    assert set(m.cached_block_hashes()) == {block_hashes(a, 4)[0], *block_hashes(list(range(100, 108)), 4),
                                           *block_hashes([7] * 4, 4)}
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_shared_prefix_refcounts_and_reused_bytes(device):
    m = make_manager(device, primary_blocks=8)
    book = PrefixBook(4)
    x = list(range(12))
    run_prefill(m, "x", x)
    book.add(x)
    m.release("x")
    y = x + [50, 51]
    assert m.admit("y", y) == 12
    assert m.block_ids("y") == [0, 1, 2, 3]
    assert_request_kv(m, "y", y, 12)
    assert m.admit("z", y) == 12  # same prompt while y is live: shares 0..2, own last block
    assert m.block_ids("z") == [0, 1, 2, 4]
    assert refs(m) == {0: (2, 0), 1: (2, 0), 2: (2, 0), 3: (1, 0), 4: (1, 0)}
    stats = m.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (12 + 14 + 14, 24)
    m.release("y")
    assert refs(m) == {0: (1, 0), 1: (1, 0), 2: (1, 0), 4: (1, 0)}
    m.release("z")
    assert refs(m) == {} and free_ids(m) == [5, 6, 7, 3, 4]
    assert book.assert_cached_blocks(m) == 3
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_lowest_priority_first_then_lru(device):
    m = make_manager(device)
    for rid, tok, prio in (("p", 1, 35), ("q", 2, 10), ("r", 3, 35)):
        run_prefill(m, rid, [tok] * 4, priority=prio)
    assert [m.block_ids(r) for r in "pqr"] == [[0], [1], [2]]
    for rid in "pqr":
        m.release(rid)
    run_prefill(m, "s", [9] * 8)  # block 3 is free; the second block evicts q (priority 10)
    assert m.block_ids("s") == [3, 1]
    run_prefill(m, "t", [8] * 4)  # then p: least recently used among priority 35
    assert m.block_ids("t") == [0]
    m.release("t")
    run_prefill(m, "u", [6] * 4)  # r (released before t) goes before t
    assert m.block_ids("u") == [2]
    assert set(m.cached_block_hashes()) == {*block_hashes([9] * 8, 4), *block_hashes([8] * 4, 4),
                                           *block_hashes([6] * 4, 4)}
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_takes_leaves_only(device):
    m = make_manager(device)
    a = list(range(12))
    run_prefill(m, "a", a)
    m.release("a")  # chain 0 -> 1 -> 2, released before d
    run_prefill(m, "d", [5] * 4)
    m.release("d")
    order = []
    for i in range(4):
        run_prefill(m, f"n{i}", [90 + i] * 4, priority=100)
        order.append(m.block_ids(f"n{i}")[0])
    assert order == [2, 1, 0, 3]  # a's chain from its leaf, although a's root is older than d
    assert m.cached_block_hashes() == [h for i in range(4) for h in block_hashes([90 + i] * 4, 4)]
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_equal_prompts_commit_once(device):
    m = make_manager(device, primary_blocks=8)
    p = list(range(9))
    assert m.admit("a", p) == 0 and m.admit("b", p) == 0  # both miss: nothing committed yet
    for rid in "ab":
        write_kv(m, rid, p, 0, 9)
        m.commit(rid, p, 9)
    assert m.block_ids("a") == [0, 1, 2] and m.block_ids("b") == [3, 4, 5]
    assert m.cached_block_hashes() == block_hashes(p, 4)  # a's blocks; b's equal blocks stay private
    m.release("b")
    assert free_ids(m) == [6, 7, 5, 4, 3]
    m.release("a")
    assert m.admit("c", p) == 8 and m.block_ids("c")[:2] == [0, 1]
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_commit_is_incremental_during_decode(device):
    m = make_manager(device, primary_blocks=8)
    p = [3, 1, 4, 1, 5]
    m.admit("a", p, num_tokens=6)
    assert m.block_ids("a") == [0, 1]
    write_kv(m, "a", p, 0, 5)
    m.commit("a", p, 5)
    assert m.cached_block_hashes() == block_hashes(p, 4)
    seq = p + [9, 2, 6]
    for n in (6, 7, 8):  # decode one token per step
        m.extend("a", n + 1)
        write_kv(m, "a", seq, n - 1, n)
        m.commit("a", seq, n)
    assert m.block_ids("a") == [0, 1, 2]
    assert m.cached_block_hashes() == block_hashes(seq, 4)
    m.release("a")
    assert m.admit("b", seq + [0]) == 8
    assert_request_kv(m, "b", seq, 8)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_reuse_disabled_caches_nothing(device):
    m = make_manager(device, enable_block_reuse=False)
    p = list(range(8))
    run_prefill(m, "a", p)
    assert m.cached_block_hashes() == []
    m.release("a")
    assert free_ids(m) == [2, 3, 1, 0]
    assert m.admit("b", p) == 0
    assert m.stats().prefix_hit_tokens == 0
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_salt_separates_namespaces(device):
    p = list(range(8))
    m = make_manager(device, primary_blocks=8, salt="model-A")
    run_prefill(m, "a", p)
    m.release("a")
    assert m.admit("b", p, salt="lora-1") == 0
    assert m.admit("c", p) == 7
    assert m.cached_block_hashes() == block_hashes(p, 4, "model-A")
    run_prefill(m, "d", p, salt="lora-1")
    assert m.admit("e", p, salt="lora-1") == 7
    assert set(m.cached_block_hashes()) == {*block_hashes(p, 4, "model-A"),
                                           *block_hashes(p, 4, "model-A\x1flora-1")}
    m.check_integrity()
