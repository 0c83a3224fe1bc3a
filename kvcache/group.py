"""One window group: the layers sharing an attention window, their block manager and pools."""

from __future__ import annotations

import logging

import torch

from kvcache.block import Level
from kvcache.block_manager import BlockManager
from kvcache.config import DEFAULT_GPU_FRACTION, KvCacheConfig
from kvcache.errors import KVCacheError
from kvcache.layout import CacheLayout
from kvcache.pool import GroupPools
from kvcache.stats import KVCacheStats

log = logging.getLogger(__name__)

# Blocks per window group sized from free GPU memory (Python objects, ~2 s per million to build: a tiny
# model on a 141 GB GPU would get 4 million, an 8B model ~27 k); kv_cache_config.max_tokens goes past it.
MAX_AUTO_BLOCKS = 1 << 18


def primary_tokens(config: KvCacheConfig, layout: CacheLayout) -> int:
    """Primary tokens per window group: config.max_tokens, else on CUDA `gpu_pool_bytes` (call it after
    loading the weights), else 8 * max_seq_len."""
    if config.max_tokens is not None:
        return config.max_tokens
    if layout.device.type != "cuda":
        return 8 * layout.max_seq_len
    free, total = torch.cuda.mem_get_info(layout.device)
    held = torch.cuda.memory_reserved(layout.device) if config.gpu_memory_share else 0
    pool, basis = gpu_pool_bytes(config, free=free, total=total, held=held)
    tokens = pool // layout.bytes_per_token()
    if tokens < config.tokens_per_block:
        raise KVCacheError(f"{basis} holds less than one KV block ({config.tokens_per_block} tokens of "
                           f"{layout.bytes_per_token()} B); set kv_cache_config.max_tokens or give this "
                           f"server more of the GPU")
    cap = MAX_AUTO_BLOCKS * config.tokens_per_block
    if tokens > cap:
        log.info("KV pool: %d tokens fit in %s; capped at %d (%d blocks; kv_cache_config.max_tokens sets "
                 "more)", tokens, basis, cap, MAX_AUTO_BLOCKS)
    return min(tokens, cap)


def gpu_pool_bytes(config: KvCacheConfig, *, free: int, total: int, held: int) -> tuple[int, str]:
    """The primary pool's bytes and their basis: the fraction of `free`, or with gpu_memory_share of
    the share of `total` less `held` (at most that of `free`: the same whichever server loads first)."""
    fraction = config.free_gpu_memory_fraction or DEFAULT_GPU_FRACTION
    of_free = int(fraction * free)
    if config.gpu_memory_share is None:
        return of_free, f"free_gpu_memory_fraction={fraction} of the free GPU memory ({free} B)"
    of_share = int(fraction * config.gpu_memory_share * total) - held
    basis = (f"gpu_memory_share={config.gpu_memory_share:g} of the GPU ({total} B) x {fraction} less the "
             f"{held} B this server holds, and at most {fraction} of the free {free} B")
    return max(0, min(of_share, of_free)), basis


def level_sizes(config: KvCacheConfig, layout: CacheLayout) -> tuple[int, int, int]:
    """Blocks per window group: primary, host (host_cache_size) and disk (disk.max_bytes)."""
    block_bytes = config.tokens_per_block * layout.bytes_per_token()
    host, disk = config.host_cache_size, config.disk.max_bytes if config.disk is not None else 0
    for name, nbytes in (("host_cache_size", host), ("disk.max_bytes", disk)):
        if 0 < nbytes < block_bytes:  # TensorRT-LLM #2225: silently no host pool
            raise ValueError(f"kv_cache_config.{name}={nbytes}: holds no block "
                             f"(one block of every layer is {block_bytes} bytes)")
    return primary_tokens(config, layout) // config.tokens_per_block, host // block_bytes, disk // block_bytes


class WindowGroup:
    def __init__(self, config: KvCacheConfig, layout: CacheLayout, window: int, num_primary: int,
                 num_secondary: int, num_disk: int = 0) -> None:
        self.window = window
        self.layers = tuple(i for i, w in enumerate(layout.layer_windows) if w == window)  # ascending
        self.bm = BlockManager(num_primary, num_secondary, num_disk,
                               offload_min_priority=config.secondary_offload_min_priority)
        self.pools = GroupPools(layout, config.tokens_per_block, len(self.layers), num_primary, num_secondary)

    def add_stats(self, s: KVCacheStats) -> None:
        """Add this group's counters and block counts to `s` (O(1))."""
        bm, slot_bytes = self.bm, self.pools.slot_bytes
        s.evictions += bm.evictions
        s.offloads += bm.moved[Level.PRIMARY, Level.SECONDARY]
        s.onboards += bm.moved[Level.SECONDARY, Level.PRIMARY]
        s.bytes_offloaded += bm.copied[Level.PRIMARY, Level.SECONDARY] * slot_bytes
        s.bytes_onboarded += bm.copied[Level.SECONDARY, Level.PRIMARY] * slot_bytes
        s.bytes_copied_primary += bm.copied[Level.PRIMARY, Level.PRIMARY] * slot_bytes
        s.disk_offloads += bm.moved[Level.SECONDARY, Level.DISK]
        s.disk_onboards += bm.moved[Level.DISK, Level.SECONDARY]
        in_use = (bm.num_in_use, 0, 0)  # in-use blocks are always primary
        for level in Level:
            if level is Level.DISK and not bm.num_slots[level]:
                continue
            free = len(bm.free[level])
            name = level.name.lower()
            s.blocks[self.window, name, "free"] = free
            s.blocks[self.window, name, "in_use"] = in_use[level]
            s.blocks[self.window, name, "cached"] = bm.num_slots[level] - free - in_use[level]
