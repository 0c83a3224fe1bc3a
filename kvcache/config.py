"""`KvCacheConfig`: the KV cache's settings, with TensorRT-LLM's `kv_cache_config` field names so the
YAML reads the same. A msgspec Struct: the deployment loader (server/config/schema.py) checks types, ranges
and unknown keys when it converts the YAML; `__post_init__` checks what spans two fields. No torch
here, so the router can read a deployment without loading it."""

from __future__ import annotations

from typing import Annotated

import msgspec

DEFAULT_GPU_FRACTION = 0.9  # TensorRT-LLM's default free_gpu_memory_fraction

Positive = Annotated[int, msgspec.Meta(gt=0)]


class KvCacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Paged KV cache settings. Capacities are per window group (VSWA: one group per window size)."""

    tokens_per_block: Positive = 32
    max_tokens: Positive | None = None  # primary capacity in tokens; None: from free memory (see manager)
    # share of the free GPU memory (after the weights) for the primary pool, when max_tokens is None
    # on CUDA; None: DEFAULT_GPU_FRACTION, which `pdserve launch` splits between servers on the GPU
    free_gpu_memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    host_cache_size: Annotated[int, msgspec.Meta(ge=0)] = 0  # bytes of the secondary (host) pool; 0 = no offload
    # evicted blocks with priority >= this are offloaded
    secondary_offload_min_priority: Annotated[int, msgspec.Meta(ge=0, le=100)] = 35
    onboard_blocks: bool = True  # reuse host-cached blocks (onboard them); False: host blocks never match

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < self.tokens_per_block:
            raise ValueError(f"max_tokens: {self.max_tokens} is below one block "
                             f"(tokens_per_block={self.tokens_per_block})")
