"""Paged KV cache manager: blocks, reuse tree, pools, offload/onboard, block id -> slot translation.

See DESIGN.md §3. Dependencies point inward only: kvcache imports nothing of server/ or transceiver/.
"""

from kvcache.block import Level
from kvcache.config import KvCacheConfig
from kvcache.errors import KVCacheError, OutOfBlocksError, UnknownBlockError
from kvcache.hashing import block_hashes, request_salt
from kvcache.layout import CacheLayout
from kvcache.manager import KVCacheManager
from kvcache.stats import KVCacheStats

__all__ = [
    "CacheLayout",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheStats",
    "KvCacheConfig",
    "Level",
    "OutOfBlocksError",
    "UnknownBlockError",
    "block_hashes",
    "request_salt",
]
