"""Errors of the KV cache manager. Every message names the request, block or window it is about."""

from __future__ import annotations


class KVCacheError(RuntimeError):
    """Base class: a request or block was used in a way the cache does not allow."""


class OutOfBlocksError(KVCacheError):
    """Not enough primary blocks (free + evictable), raised BEFORE any change: retry later or preempt."""


class UnknownBlockError(KVCacheError, KeyError):
    """A block id that does not exist, or names a free block that holds no KV."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
