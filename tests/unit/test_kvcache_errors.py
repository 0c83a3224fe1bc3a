"""Typed errors that name the request or block, and OutOfBlocksError leaving no trace."""

from __future__ import annotations

import pytest
from kv_factories import make_manager
from test_kvcache_support import DEVICES, free_ids, refs, run_prefill

from kvcache import KVCacheError, OutOfBlocksError


def _snapshot(m):
    return (m.stats(), {w: free_ids(m, w) for w in m.window_sizes}, {w: refs(m, w) for w in m.window_sizes},
            {w: m.cached_block_hashes(w) for w in m.window_sizes})


@pytest.mark.parametrize("device", DEVICES)
def test_request_errors_name_the_request(device):
    m = make_manager(device)
    m.admit("a", [1, 2, 3])
    with pytest.raises(KVCacheError, match="request 'a' is already admitted"):
        m.admit("a", [1])
    with pytest.raises(ValueError, match=r"request 'b': num_tokens=65 outside \[3, max_seq_len=64\]"):
        m.admit("b", [1, 2, 3], num_tokens=65)
    with pytest.raises(ValueError, match="request 'b': num_tokens=2 outside"):
        m.admit("b", [1, 2, 3], num_tokens=2)
    with pytest.raises(ValueError, match="request 'b': priority=101"):
        m.admit("b", [1], priority=101)
    with pytest.raises(ValueError, match="request 'b': max_cached_tokens=-1"):
        m.admit("b", [1], max_cached_tokens=-1)
    with pytest.raises(KVCacheError, match="request 'a': num_computed_tokens=5 is outside"):
        m.commit("a", [1, 2, 3, 4, 5], 5)
    with pytest.raises(KVCacheError, match="unknown request 'zz'"):
        m.extend("zz", 8)
    with pytest.raises(KVCacheError, match="unknown request 'zz'"):
        m.block_ids("zz")
    m.release("a")
    with pytest.raises(KVCacheError, match="release of unknown request 'a'"):
        m.release("a")
    assert isinstance(OutOfBlocksError("x"), KVCacheError) and issubclass(KVCacheError, RuntimeError)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_pin_errors_name_the_block(device):
    m = make_manager(device)
    m.admit("a", list(range(8)))
    m.pin_blocks([0, 1], 64)
    with pytest.raises(KVCacheError, match="unpin of block 1 .* not pinned"):
        m.unpin_blocks([0, 1, 1], 64)  # checked before any change
    assert refs(m) == {0: (1, 1), 1: (1, 1)}
    m.unpin_blocks([0, 1], 64)
    with pytest.raises(KVCacheError, match="unpin of block 0 "):
        m.unpin_blocks([0], 64)
    with pytest.raises(KeyError, match="block 3 is free"):
        m.pin_blocks([3], 64)
    with pytest.raises(ValueError, match="unknown window size 32"):
        m.pin_blocks([0], 32)


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_blocks_leaves_no_trace(device):
    m = make_manager(device, host_blocks=1)
    run_prefill(m, "a", list(range(8)))
    m.release("a")
    run_prefill(m, "b", list(range(100, 108)))
    before = _snapshot(m)
    with pytest.raises(OutOfBlocksError, match="request 'c': needs 3 primary blocks in window 64, only 0 "):
        m.admit("c", list(range(8)) + list(range(50, 62)))  # reuses a's 2 blocks, needs 3 more
    with pytest.raises(OutOfBlocksError, match="request 'b': needs 3 primary blocks"):
        m.extend("b", 20)
    assert _snapshot(m) == before
    m.check_integrity()
    m.release("b")
    assert m.admit("c", list(range(8)) + [50, 51, 52, 53]) == 8  # a request that fits still works
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_blocks_in_one_group_changes_no_group(device):
    m = make_manager(device, windows=(8, 64), primary_blocks=6, enable_block_reuse=False)
    m.admit("r", list(range(20)))
    m.release_out_of_window("r", 20)  # window 8 has 4 free blocks, window 64 only 1
    before = _snapshot(m)
    with pytest.raises(OutOfBlocksError, match="window 64"):
        m.admit("s", list(range(8)))
    assert _snapshot(m) == before
    assert m.num_available_blocks() == 1
    m.check_integrity()
