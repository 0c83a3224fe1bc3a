"""Block id -> slot translation: the three scenarios of TensorRT-LLM's test_extractor.py (PR #15245),
research/trtllm.md §4.3, plus address and byte checks."""

from __future__ import annotations

import pytest
import torch
from kv_factories import make_manager
from test_kvcache_support import DEVICES

from kvcache import KVCacheError, KVCacheManager, Level, UnknownBlockError


def _manager(device: str, windows: tuple[int, ...], max_seq_len: int, **kw) -> KVCacheManager:
    """tpb 16, 2 kv heads of 64, float16: 2 * 2 * 64 * 2 B = 512 B per layer and token."""
    return make_manager(device, tpb=16, windows=windows, max_seq_len=max_seq_len, dim=64, dtype=torch.float16, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_a_vswa_needs_window_and_is_identity_before_offload(device):
    m = _manager(device, (128, 128, 256, 256), 256, primary_blocks=32, enable_block_reuse=False)
    assert m.window_sizes == (128, 256)
    assert m.group_layers(128) == (0, 1) and m.group_layers(256) == (2, 3)
    assert m.num_slots(128) == m.num_slots(256) == 32
    m.admit("r", list(range(48)))  # 48-token prefill
    with pytest.raises(ValueError, match="window_size must be provided for VSWA"):
        m.get_memory_pool_block_indices(m.block_ids("r", 128))
    for w in (128, 256):
        ids = m.block_ids("r", w)
        assert ids == [0, 1, 2]
        assert m.get_memory_pool_block_indices(ids, window_size=w) == ids
    with pytest.raises(ValueError, match="unknown window size 64"):
        m.get_memory_pool_block_indices([0], window_size=64)
    with pytest.raises(ValueError, match="window_size must be provided"):
        m.block_ids("r")


@pytest.mark.parametrize("device", DEVICES)
def test_b_no_offload_translation_is_identity_and_addresses_are_base_plus_slot(device):
    m = _manager(device, (256, 256), 256, primary_blocks=16)
    assert m.num_slots(256) == 16 and m.num_slots(256, Level.SECONDARY) == 0
    assert m.pool(256, Level.SECONDARY) is None
    m.admit("r", list(range(32)))
    ids = m.block_ids("r")
    slots = m.get_memory_pool_block_indices(ids)
    assert ids == slots == [0, 1]
    pool = m.pool(256)
    assert pool.shape == (16, 2, 2, 16, 2, 64)
    assert m.slot_bytes(256) == 2 * 2 * 16 * 2 * 64 * 2 == pool[0].numel() * pool.element_size()
    for slot in slots:
        assert pool.data_ptr() + slot * m.slot_bytes(256) == pool[slot].data_ptr()
    k, v = m.layer_cache(1)
    assert k.shape == v.shape == (16, 16, 2, 64)
    assert k.data_ptr() == pool[0, 1, 0].data_ptr() and v.data_ptr() == pool[0, 1, 1].data_ptr()
    assert k.stride(0) * k.element_size() == m.slot_bytes(256)  # a strided view, not a copy


def _fill_pattern(m: KVCacheManager, slots: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Write bytes derived from each block's tokens into its slot; return what was written."""
    pool = m.pool(256).view(torch.int16)  # [slots, layers, 2, tpb, heads, dim]
    written = []
    for i, slot in enumerate(slots):
        g = torch.Generator().manual_seed(sum(tokens[i * 16:(i + 1) * 16]) * 7919 + i)
        data = torch.randint(-(2 ** 15), 2 ** 15, pool[slot].shape, generator=g, dtype=torch.int16)
        pool[slot] = data.to(pool.device)
        written.append(data)
    return written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy_on_partial_reuse", [True, False])
def test_c_offload_then_onboard_restores_the_written_bytes(device, copy_on_partial_reuse):
    m = _manager(device, (256, 256), 256, primary_blocks=4, host_blocks=16,
                 enable_partial_reuse=True, copy_on_partial_reuse=copy_on_partial_reuse)
    assert (m.num_slots(256), m.num_slots(256, Level.SECONDARY)) == (4, 16)
    prompt_a, prompt_b = list(range(64)), list(range(1000, 1064))
    assert m.admit("a", prompt_a) == 0
    ids_a = m.block_ids("a")
    assert m.get_memory_pool_block_indices(ids_a) == ids_a == [0, 1, 2, 3]
    written = _fill_pattern(m, ids_a, prompt_a)
    m.commit("a", prompt_a, 64)
    m.release("a")

    m.admit("b", prompt_b)  # no free block: evicts a's blocks, which go to the host pool
    assert m.block_ids("b") == [4, 5, 6, 7]
    assert m.slot_table("b", 256) == [3, 2, 1, 0]  # b reuses a's slots: ids differ from slots
    for block_id in ids_a:
        with pytest.raises(KVCacheError, match="not in the primary pool"):
            m.get_memory_pool_block_indices([block_id])
    host_slots = m.get_memory_pool_block_indices(ids_a, require_primary=False)
    assert host_slots == [3, 2, 1, 0]
    assert m.stats().offloads == 4
    if device == "cuda":
        torch.cuda.synchronize()
    host = m.pool(256, Level.SECONDARY).view(torch.int16)
    for slot, data in zip(host_slots, written, strict=True):
        assert torch.equal(host[slot], data)
    m.commit("b", prompt_b, 64)
    m.release("b")

    assert m.admit("a2", prompt_a) == 63  # 3 full blocks + 15 tokens of the last one
    stats = m.stats()
    assert stats.onboards == (4 if not copy_on_partial_reuse else 3)
    slots = m.get_memory_pool_block_indices(m.block_ids("a2"))
    assert sorted(slots) == [0, 1, 2, 3]
    if device == "cuda":
        torch.cuda.synchronize()
    pool = m.pool(256).view(torch.int16)
    for slot, data in zip(slots, written, strict=True):
        assert torch.equal(pool[slot].cpu(), data)
    m.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_translation_errors_name_the_block(device):
    m = _manager(device, (256,), 256, primary_blocks=4)
    m.admit("r", list(range(20)))
    with pytest.raises(UnknownBlockError, match="unknown block id 9 "):
        m.get_memory_pool_block_indices([0, 9])
    with pytest.raises(KeyError):
        m.get_memory_pool_block_indices([-5])
    with pytest.raises(UnknownBlockError, match="block 3 is free"):
        m.get_memory_pool_block_indices([3])
    assert m.get_memory_pool_block_indices([1, -1, 0]) == [1, -1, 0]
