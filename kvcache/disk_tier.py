"""The disk tier as the facade uses it: open (restore a previous server's blocks), check disk hits
before they are planned in, drop blocks whose bytes are lost, counters. `NoDiskTier` is its null
object (kv_cache_config.disk unset).

`check` reads the files an admission (or onboard) will bring up, in one batch over every group: it
stages the good ones' bytes (disk_pool.py) and discards the others with their subtrees (computed
instead). `after_flush` drops the blocks whose write the queue refused.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from kvcache.block import Block, Level
from kvcache.block_manager import DiskEntry
from kvcache.config import DiskTierConfig, KvCacheConfig
from kvcache.disk_format import MANIFEST_VERSION, BadFile, BlockFormat, BlockHeader, Manifest, key_id
from kvcache.disk_pool import DiskSlots
from kvcache.disk_store import BlockMeta, DiskStore
from kvcache.errors import KVCacheError
from kvcache.group import WindowGroup
from kvcache.layout import CacheLayout, dtype_name
from kvcache.stats import KVCacheStats

log = logging.getLogger(__name__)

Work = list[tuple[WindowGroup, list[Block]]]  # disk blocks to check, per window group
Item = tuple[int, int, bytes]  # (window, disk slot, block hash) of a file to read and check
# Other holders of the same disk slots (a tensor-parallel server's ranks): given a check's items they
# start reading theirs; the returned call waits and gives index -> (reason, detail) of failed ones.
PeerCheck = Callable[[list[Item]], Callable[[], dict[int, tuple[str, str]]]]


class NoDiskTier:

    peers: PeerCheck | None = None

    def check(self, work: Work) -> int:
        return 0

    def before_onboard(self, g: WindowGroup, blocks: list[Block], onboard: list[Block]) -> None:
        return None

    def describe(self, g: WindowGroup, slot: int) -> BlockMeta | None:
        return None

    def after_flush(self, g: WindowGroup) -> None:
        return None

    def add_stats(self, s: KVCacheStats) -> None:
        return None

    def close(self) -> None:
        return None


class DiskTier:
    def __init__(self, store: DiskStore, groups: Sequence[WindowGroup]) -> None:
        self.store = store
        self.dropped: Counter[str] = Counter()  # disk blocks dropped, by reason
        self.bytes_read = 0
        self.peers: PeerCheck | None = None  # other ranks' files of the same slots (`check`)
        for g in groups:
            g.pools.disk = DiskSlots(store, g.window, functools.partial(self.describe, g))

    @classmethod
    def open(cls, config: KvCacheConfig, layout: CacheLayout, salt: str, key: bytes,
             groups: Sequence[WindowGroup]) -> DiskTier:
        """Take the directory; put the blocks a matching manifest vouches for into the groups' trees."""
        assert config.disk is not None
        store, found = open_store(config.disk, config, layout, salt, key, groups)
        for g in groups:
            store.stats.restored += len(g.bm.restore_disk(_entries(found[g.window])))
        if store.stats.restored or store.stats.skipped_at_start:
            log.info("disk tier %s: %d blocks found again (files not used: %s)", store.path,
                     store.stats.restored, dict(store.stats.skipped_at_start) or "none")
        return cls(store, groups)

    def check(self, work: Work) -> int:
        """Check `work`'s disk files in one batch, staging or discarding each; returns how many failed."""
        pairs = [(g, b) for g, blocks in work for b in blocks]
        items: list[Item] = [(g.window, b.slot, b.hash) for g, b in pairs]  # type: ignore[misc]
        peers = self.peers(items) if self.peers is not None else None  # their reads run meanwhile
        own = self.store.read_many(items)
        for i, (reason, detail) in (peers() if peers is not None else {}).items():
            if not isinstance(own[i], BadFile):
                own[i] = BadFile(reason, detail)
        bad: list[tuple[WindowGroup, Block, BadFile]] = []
        for (g, b), result in zip(pairs, own, strict=True):
            if isinstance(result, BadFile):
                bad.append((g, b, result))
            else:
                assert g.pools.disk is not None
                g.pools.disk.stage(b.slot, result)
                self.bytes_read += result.nbytes
        for g, b, error in bad:
            log.warning("disk tier: window %d slot %d dropped: %s", g.window, b.slot, error)
            self._drop(g, b, error.reason, b.hash)
        return len(bad)

    def before_onboard(self, g: WindowGroup, blocks: list[Block], onboard: list[Block]) -> None:
        """Check the disk files among `onboard` (after the capacity check); KVCacheError when one failed
        (dropped with its subtree: a listed block is gone)."""
        disk = [b for b in onboard if b.level is Level.DISK]
        if disk and self.check([(g, disk)]):
            gone = [b.id for b in blocks if b.hash is None and not b.in_use]
            raise KVCacheError(f"window {g.window}: blocks {gone} were on disk, and a file they need failed "
                               f"its check: they were dropped (the KV must be computed again)")

    def describe(self, g: WindowGroup, slot: int) -> BlockMeta | None:
        """What the file of disk slot `slot` must say about the block there now (None: free)."""
        b = g.bm.owners[Level.DISK][slot]
        if b.hash is None:
            return None
        parent = b.parent
        root_salt = g.bm.tree.root_salt(b) if parent is None else b""
        return BlockMeta(b.hash, None if parent is None else parent.hash, root_salt, b.tokens, b.priority)

    def after_flush(self, g: WindowGroup) -> None:
        """Drop the blocks whose write the queue refused during the call that just ended."""
        assert g.pools.disk is not None
        for slot in g.pools.disk.end_call():
            owner = g.bm.owners[Level.DISK][slot]
            self._drop(g, owner, "queue_full", owner.hash)

    def add_stats(self, s: KVCacheStats) -> None:
        io = self.store.stats
        s.disk_bytes_read = self.bytes_read
        s.disk_bytes_written, s.disk_write_errors = io.bytes_written, io.write_errors
        s.disk_queued_bytes, s.disk_restored = io.queued_bytes, io.restored
        s.disk_dropped = dict(self.dropped)

    def close(self) -> None:
        self.store.close()

    def _drop(self, g: WindowGroup, b: Block, reason: str, block_hash: bytes | None) -> None:
        """Discard disk block b unless it already left (dropped with a failed ancestor, or moved)."""
        if b.level is not Level.DISK or block_hash is None or b.hash != block_hash:
            return
        self.dropped[reason] += 1
        if reason not in ("missing", "timeout", "queue_full"):
            self.store.delete(g.window, b.slot)
        g.bm.discard(b)


def open_store(disk: DiskTierConfig, config: KvCacheConfig, layout: CacheLayout, salt: str, key: bytes,
               groups: Sequence[WindowGroup],
               num_disk: int | None = None) -> tuple[DiskStore, dict[int, list[BlockHeader]]]:
    """`DiskStore.open` for `groups`' files (`num_disk` slots each; default: their own) of this model, windows,
    KV format (an FP8 group's layers' scales) and key, with buffers reserved for a hit of a whole host
    pool: a read for each block, a write for each displaced."""
    f = layout.format
    manifest = Manifest(MANIFEST_VERSION, salt, dtype_name(f.dtype), config.tokens_per_block, layout.layer_windows,
                        f.num_kv_heads, f.head_dim, key_id(key), f.k_scales, f.v_scales, f.layout)
    slots = {g.window: (g.bm.num_slots[Level.DISK] if num_disk is None else num_disk, g.pools.slot_bytes)
             for g in groups}
    formats = {g.window: BlockFormat(dtype_name(f.dtype), f.block_scales(g.layers)) for g in groups}
    store, found = DiskStore.open(disk, key, manifest, slots, formats)
    for g in groups:
        if g.pools.secondary is not None:
            store.buffers.reserve(g.pools.slot_bytes, 2 * g.pools.secondary.shape[0])
    return store, found


def _entries(headers: list[BlockHeader]) -> list[DiskEntry]:
    """Restore entries, parents first and, at equal depth, oldest first; of two files of a block the
    newer counts; a block without its parent's file (or in a loop) is left out with its subtree."""
    newest: dict[bytes, BlockHeader] = {}
    for h in sorted(headers, key=lambda h: h.written_ns):
        newest[h.block_hash] = h
    position = {block_hash: i for i, block_hash in enumerate(newest)}
    children: dict[bytes | None, list[BlockHeader]] = {}
    for h in newest.values():
        children.setdefault(h.parent_hash, []).append(h)
    ordered: list[BlockHeader] = []
    level = children.get(None, [])  # the root children, then each depth in turn
    while level:
        ordered += sorted(level, key=lambda h: (h.written_ns, position[h.block_hash]))
        level = [c for h in level for c in children.get(h.block_hash, [])]
    return [(h.slot, h.block_hash, h.parent_hash, h.tokens, h.root_salt, h.priority) for h in ordered]
