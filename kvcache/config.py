"""`KvCacheConfig`: the KV cache's settings, with TensorRT-LLM's `kv_cache_config` field names. A msgspec
Struct (types, ranges and unknown keys checked on conversion; `__post_init__`: what spans two fields).
No torch, so the router can read a deployment."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

DEFAULT_GPU_FRACTION = 0.9  # TensorRT-LLM's default free_gpu_memory_fraction

Positive = Annotated[int, msgspec.Meta(gt=0)]


class DiskTierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`kv_cache_config.disk`: a level behind the host pool. Blocks it evicts (at or above
    secondary_offload_min_priority) go to files under `path`, read back on a hit; a server of the same
    model, KV layout and deployment token finds them again after a restart."""

    path: Annotated[str, msgspec.Meta(min_length=1)]  # a directory, created if missing; one per server
    max_bytes: Positive  # KV bytes the tier holds (block files add a small header each)
    # bytes of offloaded blocks waiting for their write (beyond it the block is dropped: the engine
    # never waits for the disk); up to twice this in buffers is kept for reuse (disk_buffers.py)
    write_queue_bytes: Positive = 256 << 20
    read_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8  # files read and checked at once on a hit
    write_threads: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2
    io_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # one hit's reads; the writes' flush at close

    def for_rank(self, rank: int) -> DiskTierConfig:
        """A tensor-parallel rank's directory: `path` for rank 0, `path.rank<r>` for the others."""
        return self if rank == 0 else msgspec.structs.replace(self, path=f"{self.path}.rank{rank}")


class KvCacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Paged KV cache settings. Capacities are per window group (VSWA: one group per window size)."""

    tokens_per_block: Positive = 32
    max_tokens: Positive | None = None  # primary capacity in tokens; None: from free memory (see manager)
    # share of the free GPU memory (after the weights) for the primary pool, when max_tokens is None
    # on CUDA; None: DEFAULT_GPU_FRACTION, which `pdserve launch` splits between servers on the GPU
    free_gpu_memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    # this server's share of the GPU's total memory, for servers sharing one GPU (kvcache.group
    # `gpu_pool_bytes`); `pdserve launch` gives each of n servers 1/n when neither this, max_tokens
    # nor free_gpu_memory_fraction is set
    gpu_memory_share: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    host_cache_size: Annotated[int, msgspec.Meta(ge=0)] = 0  # bytes of the secondary (host) pool; 0 = no offload
    # evicted blocks with priority >= this are offloaded
    secondary_offload_min_priority: Annotated[int, msgspec.Meta(ge=0, le=100)] = 35
    onboard_blocks: bool = True  # reuse host-cached blocks (onboard them); False: host blocks never match
    disk: DiskTierConfig | None = None  # a disk tier behind the host pool; None: none
    # the blocks' element type: "auto" (the model's dtype) or "fp8" (e4m3, one byte: twice bf16's tokens
    # in the same bytes), with per-layer k/v scales from `scales`, else the checkpoint's, else 1.0
    dtype: Literal["auto", "fp8"] = "auto"
    scales: Annotated[str, msgspec.Meta(min_length=1)] | None = None  # a scales file (`pdserve calibrate-kv`)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < self.tokens_per_block:
            raise ValueError(f"max_tokens: {self.max_tokens} is below one block "
                             f"(tokens_per_block={self.tokens_per_block})")
        if self.scales is not None and self.dtype != "fp8":
            raise ValueError(f"scales: {self.scales!r} is for an FP8 cache (dtype: fp8), the dtype is {self.dtype!r}")
        if self.disk is not None and self.host_cache_size == 0:
            raise ValueError("disk: needs a host pool (host_cache_size > 0): the disk tier takes the "
                             "blocks the host pool evicts, and hands blocks back through it")
