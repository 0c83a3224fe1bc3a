"""The disk files of a manager whose bookkeeping is another manager's (a tensor-parallel rank's).

Each rank of a tensor-parallel server keeps files of its own kv heads: a directory of its own, the
same disk slots as rank 0's manager (which decides every move), the same key, a manifest of its own
layout. Rank 0's copies reach the rank in order (`KVCacheManager.apply_copies`), a host -> disk copy
with what each file must say about its block (`before_copies`). Before rank 0 plans a disk hit in,
every rank reads and checks the same files (`check`; kvcache/disk_tier.py `PeerCheck`), so a block
comes up only where every rank has its bytes; a file left from before is read only when rank 0's
books name it, and a file of another block fails its check.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from kvcache.config import DiskTierConfig, KvCacheConfig
from kvcache.disk_format import BadFile
from kvcache.disk_pool import DiskSlots
from kvcache.disk_store import BlockMeta, DiskStore
from kvcache.disk_tier import Item, block_formats, manifest_of, reserve_buffers
from kvcache.group import WindowGroup
from kvcache.layout import CacheLayout


class DiskMirror:
    def __init__(self, store: DiskStore, groups: Sequence[WindowGroup]) -> None:
        self.store = store
        self._slots: dict[int, DiskSlots] = {}
        self._meta: dict[int, dict[int, BlockMeta]] = {}  # window -> disk slot -> its block, for this batch
        for g in groups:
            describe = functools.partial(self._describe, g.window)
            g.pools.disk = self._slots[g.window] = DiskSlots(store, g.window, describe)
        reserve_buffers(store, groups)

    @classmethod
    def open(cls, disk: DiskTierConfig, config: KvCacheConfig, layout: CacheLayout, salt: str, key: bytes,
             groups: Sequence[WindowGroup], num_disk: int) -> DiskMirror:
        """Take `disk.path` for this rank's files of `num_disk` slots per window group."""
        slots = {g.window: (num_disk, g.pools.slot_bytes) for g in groups}
        store, _ = DiskStore.open(disk, key, manifest_of(config, layout, salt, key), slots,
                                  block_formats(layout, groups))
        return cls(store, groups)

    def check(self, items: list[Item]) -> dict[int, tuple[str, str]]:
        """Read and check these files; stage the good ones' bytes for the copies that follow, and
        return index -> (reason, detail) of the others. What an earlier check staged is forgotten."""
        for slots in self._slots.values():
            slots.forget()
        bad = {}
        for i, ((window, slot, _), result) in enumerate(zip(items, self.store.read_many(items), strict=True)):
            if isinstance(result, BadFile):
                bad[i] = (result.reason, str(result))
            else:
                self._slots[window].stage(slot, result)
        return bad

    def before_copies(self, window: int, metas: dict[int, BlockMeta]) -> None:
        """The blocks of the disk slots the next copies of `window` write (rank 0's, as it wrote them)."""
        self._meta[window] = metas

    def after_copies(self, window: int) -> None:
        """Forget the batch: its metas, its staged bytes (used), its refused writes (their files never
        appear, so a later check of those slots fails and rank 0 drops the block)."""
        self._meta.pop(window, None)
        self._slots[window].end_call()

    def close(self) -> None:
        self.store.close()

    def _describe(self, window: int, slot: int) -> BlockMeta | None:
        return self._meta.get(window, {}).get(slot)
