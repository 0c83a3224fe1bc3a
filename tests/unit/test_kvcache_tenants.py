"""Tenants in the KV cache manager: cache salts on every tier, retention priorities under pool
pressure (exact block ids), the generation side's whole-block admission, and the cheap accounting
check the engine's health check runs."""

from __future__ import annotations

from collections import Counter

import pytest
from kv_factories import make_manager
from test_kvcache_support import DEVICES, assert_request_kv, locate, run_prefill

from kvcache import KVCacheError, block_hashes, request_salt

T = list(range(10, 18))  # two blocks of 4


@pytest.mark.parametrize("device", DEVICES)
def test_different_salts_never_share_a_block_on_either_tier(device):
    m = make_manager(device, host_blocks=8, salt="model")
    assert run_prefill(m, "a", T, salt="tenant-a") == 0
    m.release("a")
    assert run_prefill(m, "a-again", T, salt="tenant-a") == 7  # equal salts share
    m.release("a-again")
    run_prefill(m, "fill", list(range(100, 116)), salt="tenant-a")  # a's blocks go to the host tier
    m.release("fill")
    assert locate(m, [0, 1]) == [("s", 1), ("s", 0)]
    assert m.admit("b", T, salt="tenant-b") == 0  # not the primary tier, not the host tier
    m.release("b")
    assert m.admit("b-partial", T[:3] + [99], salt="tenant-b", max_cached_tokens=4) == 0  # nor partly
    m.release("b-partial")
    assert m.admit("unsalted", T) == 0
    m.release("unsalted")
    assert m.admit("a3", T, salt="tenant-a") == 7  # onboarded from the host tier
    assert_request_kv(m, "a3", T, 7)
    assert set(block_hashes(T, 4, request_salt("model", "tenant-a"))) <= set(m.cached_block_hashes())
    assert not set(block_hashes(T, 4, request_salt("model", "tenant-b"))) & set(m.cached_block_hashes())
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_low_priority_blocks_go_first_and_only_high_ones_reach_the_host_tier(device):
    m = make_manager(device, primary_blocks=4, host_blocks=4, secondary_offload_min_priority=50)
    high, low = [1] * 4 + [2] * 4, [3] * 4 + [4] * 4
    run_prefill(m, "high", high, priority=80)
    run_prefill(m, "low", low, priority=20)
    assert (m.block_ids("high"), m.block_ids("low")) == ([0, 1], [2, 3])
    m.release("high")  # released first: plain LRU would evict it first
    m.release("low")
    run_prefill(m, "new", list(range(200, 216)))  # 4 blocks: every cached block must go
    # low's leaf then its root are dropped (priority 20 < 50); high's leaf then root are offloaded
    # (80 >= 50), and the host blocks 4 and 5 they swapped slots with serve the new request
    assert m.block_ids("new") == [3, 2, 4, 5]
    assert locate(m, [1, 0]) == [("s", 0), ("s", 1)]
    s = m.stats()
    assert (s.evictions, s.offloads) == (4, 2)
    m.release("new")
    assert m.admit("low-again", low) == 0
    m.release("low-again")
    assert m.admit("high-again", high) == 7  # back from the host tier
    assert_request_kv(m, "high-again", high, 7)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_a_partly_matching_block_is_reused_only_if_it_completes_the_prompt(device):
    m = make_manager(device, primary_blocks=8)
    run_prefill(m, "first", T + [20, 21, 22, 23])  # three full blocks in the tree
    m.release("first")
    copied = m.stats().bytes_copied_primary
    whole = T + [20, 21]  # its last block matches 2 tokens of a cached block: the prompt is complete
    assert m.admit("whole", whole, max_cached_tokens=len(whole), partial_only_if_complete=True) == 10
    assert m.stats().bytes_copied_primary == copied + m.slot_bytes(64)
    shorter = T + [20, 99]  # 1 token of that block matches: the rest would come by a whole block
    assert m.admit("short", shorter, max_cached_tokens=len(shorter), partial_only_if_complete=True) == 8
    assert m.stats().bytes_copied_primary == copied + m.slot_bytes(64)  # no wasted copy
    assert m.admit("plain", shorter, max_cached_tokens=len(shorter)) == 9  # the default reuses it
    m.check_integrity()


def test_counters_and_the_cheap_accounting_check():
    m = make_manager("cpu", primary_blocks=8)
    run_prefill(m, "a", T)
    run_prefill(m, "b", T + [1, 2, 3, 4])
    m.pin_blocks(m.block_ids("a"), 64)
    m.pin_blocks(m.block_ids("a")[:1], 64)
    assert m.num_pins(64) == 3
    assert m.pinned_blocks(64) == Counter({0: 2, 1: 1})
    assert sorted(m.request_ids()) == ["a", "b"]
    m.check_accounting()
    m.check_integrity()
    bm = m._groups[0].bm
    bm.num_refs += 1  # a reference nobody holds: what a leaked request would look like
    with pytest.raises(KVCacheError, match="blocks count 6 request references, live requests hold 5"):
        m.check_accounting()
    bm.num_refs -= 1
    bm.num_in_use += 8
    with pytest.raises(KVCacheError, match="num_in_use=11 outside"):
        m.check_accounting()
    bm.num_in_use -= 8
    m.unpin_blocks(m.block_ids("a") + m.block_ids("a")[:1], 64)
    assert m.num_pins(64) == 0 and m.pinned_blocks(64) == Counter()
    m.check_accounting()
