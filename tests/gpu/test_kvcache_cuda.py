"""CUDA-only checks of the KV cache pools (the unit tests also run every scenario on CUDA when it is
present): pinned host pool, sizing from free GPU memory, offload/onboard on the current stream."""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheLayout, KvCacheConfig, KVCacheManager, KVFormat, Level
from kvcache.group import MAX_AUTO_BLOCKS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _layout() -> CacheLayout:
    return CacheLayout((64, 64), KVFormat(torch.bfloat16, 2, 8), "cuda", 64)


def test_pools_live_on_the_gpu_and_the_host_pool_is_pinned():
    m = KVCacheManager(KvCacheConfig(tokens_per_block=4, max_tokens=64, host_cache_size=1 << 16), _layout())
    assert m.pool(64).device.type == "cuda"
    host = m.pool(64, Level.SECONDARY)
    assert host.device.type == "cpu" and host.is_pinned()
    assert m.num_slots(64, Level.SECONDARY) == (1 << 16) // _layout().bytes_per_token() // 4


def test_max_tokens_from_free_gpu_memory_fraction():
    layout = _layout()
    free, _ = torch.cuda.mem_get_info()
    # 0.001 of an H200's free memory is ~34 k blocks of this layout: under the cap of an automatic pool
    m = KVCacheManager(KvCacheConfig(tokens_per_block=32, free_gpu_memory_fraction=0.001), layout)
    expected = min(int(0.001 * free) // layout.bytes_per_token() // 32, MAX_AUTO_BLOCKS)
    assert abs(m.num_slots(64) - expected) <= expected // 100 + 1  # free memory moves a little


def test_offload_onboard_round_trip_on_a_side_stream():
    m = KVCacheManager(KvCacheConfig(tokens_per_block=4, max_tokens=16, host_cache_size=1 << 16), _layout())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the pools were zeroed on the default stream
    with torch.cuda.stream(stream):
        a = list(range(16))
        m.admit("a", a, max_cached_tokens=0)
        slots = m.slot_table("a", 64)
        data = torch.randn((4, *m.pool(64).shape[1:]), device="cuda").to(torch.bfloat16)
        m.pool(64)[slots] = data
        m.commit("a", a, 16)
        m.release("a")
        m.admit("b", list(range(100, 116)))  # offloads all of a (device -> pinned host, async)
        m.release("b")
        m.ensure_primary(list(range(4)))  # onboards them back (host -> device), ordered on `stream`
        back = m.pool(64)[m.get_memory_pool_block_indices(list(range(4)))]
    stream.synchronize()
    assert torch.equal(back, data)
    assert m.stats().offloads == 4 and m.stats().onboards == 4
