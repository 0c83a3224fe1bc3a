"""Exact-state tests of `KVCacheManager.fork` (the n choices of one prompt): block ids, ref counts,
free lists and bytes after fork and release in every order, with reuse off, host offload and VSWA.
tpb 4; 8 primary blocks unless stated."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from test_kvcache_support import (
    DEVICES,
    PrefixBook,
    assert_request_kv,
    free_ids,
    locate,
    make_manager,
    refs,
    run_prefill,
    write_kv,
)

from kvcache import KVCacheError, OutOfBlocksError, block_hashes

PROMPT = list(range(10))  # two full blocks and a partial one of 2 tokens


def _fork_prompt(m, **kw):
    run_prefill(m, "p", PROMPT, **kw)
    m.fork("p", "c", len(PROMPT))


def _release_one(m, order: tuple[str, str]) -> tuple[str, str, dict[str, int]]:
    """After `_fork_prompt` (8 primary blocks): the first of `order` released, the other keeps the two
    shared full blocks and its own partial one; the first's partial block is free. (first, second,
    each one's own partial block id)."""
    first, second = order
    m.release(first)
    own = {"p": 2, "c": 3}
    assert refs(m) == {0: (1, 0), 1: (1, 0), own[second]: (1, 0)}
    assert free_ids(m) == [4, 5, 6, 7, own[first]]
    return first, second, own


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", [("p", "c"), ("c", "p")])
def test_full_blocks_are_shared_and_the_partial_block_is_copied(device, order):
    m = make_manager(device, primary_blocks=8)
    _fork_prompt(m)
    assert m.block_ids("p") == [0, 1, 2] and m.block_ids("c") == [0, 1, 3]
    assert refs(m) == {0: (2, 0), 1: (2, 0), 2: (1, 0), 3: (1, 0)}
    assert free_ids(m) == [4, 5, 6, 7]
    assert m.request_ids() == ["p", "c"]
    assert_request_kv(m, "c", PROMPT, 10)  # block 3 got block 2's bytes
    s = m.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (10, 0)  # a fork is no admission
    m.check_integrity()
    first, second, own = _release_one(m, order)
    m.check_integrity()
    m.release(second)
    assert refs(m) == {} and free_ids(m) == [4, 5, 6, 7, own[first], own[second]]
    assert m.cached_block_hashes() == block_hashes(PROMPT, 4)  # the two full blocks, cached once
    assert m.num_available_blocks() == 8
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", [("p", "c"), ("c", "p")])
def test_without_reuse_shared_blocks_are_freed_by_the_last_release(device, order):
    m = make_manager(device, primary_blocks=8, enable_block_reuse=False)
    _fork_prompt(m)
    assert m.block_ids("c") == [0, 1, 3] and m.cached_block_hashes() == []
    assert_request_kv(m, "c", PROMPT, 10)
    m.check_integrity()
    first, second, own = _release_one(m, order)
    m.release(second)
    assert free_ids(m) == [4, 5, 6, 7, own[first], own[second], 1, 0]  # released last block first
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_choices_diverge_after_the_fork_and_commit_their_own_blocks(device):
    m = make_manager(device, primary_blocks=8)
    book = PrefixBook(4)
    _fork_prompt(m)
    ptoks, ctoks = PROMPT + [60, 61], PROMPT + [50, 51]
    for rid, toks in (("c", ctoks), ("p", ptoks)):
        m.extend(rid, 12)
        write_kv(m, rid, toks, 10, 12)
        m.commit(rid, toks, 12)
        book.add(toks)
    assert_request_kv(m, "p", ptoks, 12)
    assert_request_kv(m, "c", ctoks, 12)
    tree = block_hashes(ptoks, 4)
    assert m.cached_block_hashes() == [tree[0], tree[1], block_hashes(ctoks, 4)[2], tree[2]]  # c committed first
    m.release("p")
    m.release("c")
    assert refs(m) == {} and free_ids(m) == [4, 5, 6, 7]
    assert book.assert_cached_blocks(m) == 4
    assert m.admit("again", ctoks + [1]) == 12  # c's continuation is reused whole
    assert m.block_ids("again") == [0, 1, 3, 4]
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_fork_on_a_block_boundary_or_earlier_than_the_parent(device):
    m = make_manager(device, primary_blocks=8)
    toks = list(range(13))
    run_prefill(m, "p", toks)  # blocks 0, 1, 2 full and committed, 3 partial
    m.fork("p", "whole", 8)
    m.fork("p", "none", 0)
    m.fork("p", "early", 6)  # block 1 holds tokens 4..7: its first two are copied into a new block
    assert (m.block_ids("whole"), m.block_ids("none"), m.block_ids("early")) == ([0, 1], [], [0, 4])
    assert refs(m) == {0: (3, 0), 1: (2, 0), 2: (1, 0), 3: (1, 0), 4: (1, 0)}
    assert_request_kv(m, "early", toks, 6)
    etoks = toks[:6] + [70, 71]
    write_kv(m, "early", etoks, 6, 8)
    m.commit("early", etoks, 8)  # its block 1 differs from p's: committed beside it, under block 0
    assert m.cached_block_hashes() == block_hashes(toks, 4) + [block_hashes(etoks, 4)[1]]
    for rid in ("p", "whole", "none", "early"):
        m.release(rid)
    assert refs(m) == {} and free_ids(m) == [5, 6, 7, 3]
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_fork_of_a_fork_released_in_every_order(device):
    m = make_manager(device, primary_blocks=8)
    _fork_prompt(m)
    m.fork("c", "g", 9)
    held = {"p": [0, 1, 2], "c": [0, 1, 3], "g": [0, 1, 4]}
    assert {rid: m.block_ids(rid) for rid in held} == held
    assert_request_kv(m, "g", PROMPT, 9)
    m.check_integrity()
    snapshot = (refs(m), free_ids(m))
    for order in itertools.permutations(held):
        m2 = make_manager(device, primary_blocks=8)
        _fork_prompt(m2)
        m2.fork("c", "g", 9)
        assert (refs(m2), free_ids(m2)) == snapshot
        for i, rid in enumerate(order):
            m2.release(rid)
            live = Counter(b for r in order[i + 1:] for b in held[r])
            assert refs(m2) == {b: (n, 0) for b, n in live.items()}
            assert free_ids(m2) == [5, 6, 7] + [held[r][2] for r in order[:i + 1]]
            m2.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_no_block_for_the_copy_changes_nothing(device):
    m = make_manager(device, primary_blocks=4)
    run_prefill(m, "p", PROMPT)
    run_prefill(m, "q", [9] * 4)  # the last block, in use
    before = (refs(m), free_ids(m), m.request_ids())
    with pytest.raises(OutOfBlocksError, match="fork of request 'p' into 'c'"):
        m.fork("p", "c", 10)
    assert (refs(m), free_ids(m), m.request_ids()) == before
    m.fork("p", "aligned", 8)  # no partial block: nothing to allocate
    assert m.block_ids("aligned") == [0, 1]
    m.release("q")  # q's block is cached now: the copy evicts it
    m.fork("p", "c", 10)
    assert m.block_ids("c") == [0, 1, 3]
    assert m.cached_block_hashes() == block_hashes(PROMPT, 4)
    assert_request_kv(m, "c", PROMPT, 10)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_forks_are_refused_before_any_change(device):
    m = make_manager(device, primary_blocks=8)
    _fork_prompt(m)
    before = (refs(m), free_ids(m), m.request_ids())
    with pytest.raises(KVCacheError, match="unknown request 'x'"):
        m.fork("x", "y", 4)
    with pytest.raises(KVCacheError, match="'c' is already admitted"):
        m.fork("p", "c", 4)
    with pytest.raises(KVCacheError, match=r"num_tokens=13 outside \[0, 12\]"):
        m.fork("p", "y", 13)
    assert (refs(m), free_ids(m), m.request_ids()) == before
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_the_copy_lands_after_the_offload_its_block_needed(device):
    """The child's block is the slot of a cached block that the fork's allocation offloads: the
    offload's copy runs first, then the partial block's copy into that slot."""
    m = make_manager(device, primary_blocks=4, host_blocks=2)
    book = PrefixBook(4)
    run_prefill(m, "q", [9] * 4, book)
    m.release("q")
    run_prefill(m, "p", PROMPT, book)
    assert m.block_ids("p") == [1, 2, 3] and free_ids(m) == []
    m.fork("p", "c", 10)
    assert m.block_ids("c") == [1, 2, 4] and m.slot_table("c", 64) == [1, 2, 0]
    assert locate(m, [0, 4]) == [("s", 0), ("p", 0)]  # q's block went to the host, its slot to c
    assert_request_kv(m, "c", PROMPT, 10)
    assert book.assert_cached_blocks(m) == 3  # q's bytes on the host, p's two full blocks
    m.release("p")
    m.release("c")
    assert free_ids(m) == [3, 4]
    q2 = [9] * 4 + [8]
    assert m.admit("q2", q2) == 4  # q's block comes back from the host into the first free slot
    assert m.block_ids("q2") == [0, 4] and m.slot_table("q2", 64) == [3, 0]
    assert_request_kv(m, "q2", q2, 4)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_vswa_out_of_window_entries_stay_out_and_every_group_must_fit(device):
    m = make_manager(device, windows=(8, 64, 8, 64), primary_blocks=8, enable_block_reuse=False)
    toks = list(range(18))
    m.admit("p", toks)
    write_kv(m, "p", toks, 0, 18)
    assert m.release_out_of_window("p", 18) == 2  # window 8: token 18 sees positions 11..18
    m.admit("q", list(range(100, 112)))  # window 64 is full now, window 8 has 2 free blocks
    assert (free_ids(m, 8), free_ids(m, 64)) == ([0, 1], [])
    before = (refs(m, 8), refs(m, 64), free_ids(m, 8), m.request_ids())
    with pytest.raises(OutOfBlocksError, match="window 64"):
        m.fork("p", "c", 18)
    assert (refs(m, 8), refs(m, 64), free_ids(m, 8), m.request_ids()) == before
    with pytest.raises(KVCacheError, match="its block 1 .window 8., which holds token 5, was released"):
        m.fork("p", "c", 6)
    m.release("q")
    m.fork("p", "c", 18)
    assert (m.block_ids("c", 8), m.block_ids("c", 64)) == ([-1, -1, 2, 3, 0], [0, 1, 2, 3, 7])
    assert refs(m, 8) == {2: (2, 0), 3: (2, 0), 4: (1, 0), 0: (1, 0)}
    assert refs(m, 64) == {0: (2, 0), 1: (2, 0), 2: (2, 0), 3: (2, 0), 4: (1, 0), 7: (1, 0)}
    assert_request_kv(m, "c", toks, 18)
    m.check_integrity()
    ctoks = toks + [200]
    m.extend("c", 19)
    write_kv(m, "c", ctoks, 18, 19)
    assert m.release_out_of_window("c", 19) == 1  # its reference to block 2; p still holds it
    assert m.block_ids("c", 8) == [-1, -1, -1, 3, 0] and refs(m, 8)[2] == (1, 0)
    m.release("p")
    assert (free_ids(m, 8), free_ids(m, 64)) == ([1, 7, 6, 5, 4, 2], [6, 5, 4])
    m.release("c")
    assert (free_ids(m, 8), free_ids(m, 64)) == ([1, 7, 6, 5, 4, 2, 0, 3], [6, 5, 4, 7, 3, 2, 1, 0])
    m.check_integrity()
