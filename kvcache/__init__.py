"""Paged KV cache manager (docs/structure.md); imports nothing of server/ or transceiver/. The names
below load on first use (PEP 562), so the router (`Level`, block hashing) does not import torch.
"""

from importlib import import_module

_HOMES = {
    "CacheLayout": "kvcache.layout",
    "KVFormat": "kvcache.kv_format",
    "KvCacheConfig": "kvcache.config",
    "KVCacheError": "kvcache.errors",
    "OutOfBlocksError": "kvcache.errors",
    "UnknownBlockError": "kvcache.errors",
    "KVCacheManager": "kvcache.manager",
    "KVCacheStats": "kvcache.stats",
    "Level": "kvcache.block",
    "block_hashes": "kvcache.hashing",
    "request_salt": "kvcache.hashing",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
