"""Partial reuse of a partly matching block: copy (copy_on_partial_reuse) or take-over, and the
capped case of a fully matching prompt. tpb 4, one layer."""

from __future__ import annotations

import pytest
from kv_factories import make_manager
from test_kvcache_support import DEVICES, PrefixBook, assert_request_kv, free_ids, refs, run_prefill

from kvcache import block_hashes

P = list(range(10))  # blocks (0 1 2 3) (4 5 6 7) (8 9)
Q = [0, 1, 2, 3, 4, 5, 77, 78]  # shares 4 tokens + 2 of P's second block


@pytest.mark.parametrize("device", DEVICES)
def test_partial_copy_into_a_new_block(device):
    m = make_manager(device, primary_blocks=8)
    book = PrefixBook(4)
    run_prefill(m, "p", P, book)
    m.release("p")
    assert m.admit("q", Q) == 6
    assert m.block_ids("q") == [0, 3]  # block 3: the copy of block 1 (which stays cached)
    assert_request_kv(m, "q", Q, 6)
    assert m.stats().bytes_copied_primary == m.slot_bytes(64)
    assert m.cached_block_hashes() == block_hashes(P, 4)
    assert refs(m) == {0: (1, 0), 3: (1, 0)}
    assert book.assert_cached_blocks(m) == 2
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_partial_take_over_of_an_unreferenced_leaf(device):
    m = make_manager(device, primary_blocks=8, copy_on_partial_reuse=False)
    run_prefill(m, "p", P)
    m.release("p")
    assert m.admit("q", Q) == 6
    assert m.block_ids("q") == [0, 1]  # block 1 left the tree and became q's private block
    assert_request_kv(m, "q", Q, 6)
    assert m.cached_block_hashes() == block_hashes(P, 4)[:1]
    assert m.stats().bytes_copied_primary == 0
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_take_over_refuses_a_referenced_block(device):
    m = make_manager(device, primary_blocks=8, copy_on_partial_reuse=False)
    run_prefill(m, "p", P)  # p still holds block 1
    assert m.admit("q", Q) == 4
    assert m.block_ids("q") == [0, 3]
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_partial_reuse_disabled(device):
    m = make_manager(device, primary_blocks=8, enable_partial_reuse=False)
    run_prefill(m, "p", P)
    m.release("p")
    assert m.admit("q", Q) == 4
    assert m.admit("r", P[:8]) == 4  # capped at 7 tokens: the second block cannot be reused whole
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy", [True, False])
def test_fully_matching_prompt_reuses_tpb_minus_one_tokens_of_its_last_block(device, copy):
    m = make_manager(device, primary_blocks=8, copy_on_partial_reuse=copy)
    p8 = P[:8]
    run_prefill(m, "p", p8)
    m.release("p")
    assert free_ids(m) == [2, 3, 4, 5, 6, 7]
    assert m.admit("q", p8) == 7  # the last prompt token must be computed for its logits
    assert m.block_ids("q") == ([0, 2] if copy else [0, 1])
    assert_request_kv(m, "q", p8, 7)
    # with take-over, block 1 left the tree for q, so only the first block remains to match
    assert m.admit("r", p8, max_cached_tokens=8) == (8 if copy else 4)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_max_cached_tokens_caps_the_hit(device):
    m = make_manager(device, primary_blocks=8)
    run_prefill(m, "p", P)
    m.release("p")
    assert m.admit("a", P, max_cached_tokens=0) == 0
    assert m.admit("b", P, max_cached_tokens=5) == 5
    assert m.block_ids("b")[0] == 0 and m.block_ids("b")[1] != 1
    assert m.stats().prefix_hit_tokens == 5
    m.check_integrity()
