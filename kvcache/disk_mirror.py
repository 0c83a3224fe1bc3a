"""The disk files of a manager whose bookkeeping is another's (a tensor-parallel rank's).

Each rank keeps files of its own kv heads (own directory and manifest; rank 0's slots and key).
Rank 0's copies arrive in order (`apply_copies`), host -> disk ones with their metadata
(`before_copies`); every rank checks a disk hit's files before rank 0 plans it (`check`,
disk_tier.py `PeerCheck`), so a block comes up only where every rank has its bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from kvcache.disk_format import BadFile
from kvcache.disk_pool import DiskSlots
from kvcache.disk_store import BlockMeta, DiskStore
from kvcache.disk_tier import Item
from kvcache.group import WindowGroup


class DiskMirror:
    def __init__(self, store: DiskStore, groups: Sequence[WindowGroup]) -> None:
        self.store = store
        self._slots: dict[int, DiskSlots] = {}
        self._meta: dict[int, dict[int, BlockMeta]] = {}  # window -> disk slot -> its block, for this batch
        for g in groups:
            describe = functools.partial(self._describe, g.window)
            g.pools.disk = self._slots[g.window] = DiskSlots(store, g.window, describe)

    def check(self, items: list[Item]) -> dict[int, tuple[str, str]]:
        """Check these files (forgetting earlier ones): stage the good, return index -> (reason, detail)."""
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
        """Forget the batch: metas, staged bytes, refused writes (a later check fails; rank 0 drops them)."""
        self._meta.pop(window, None)
        self._slots[window].end_call()

    def close(self) -> None:
        self.store.close()

    def _describe(self, window: int, slot: int) -> BlockMeta | None:
        return self._meta.get(window, {}).get(slot)
