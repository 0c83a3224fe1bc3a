"""Blocks of one window group at three levels: free lists, ref counts and pins, the reuse tree,
eviction (priority, then LRU, leaves of each level only), offload one level down, onboard one up.
Pure Python: data moves are recorded as `CopyOp`s in `copies`, which the pools execute.

Invariants between public calls (`kvcache.integrity.check_block_manager`):
- each block is exactly one of: free, cached (in the tree, ref == pins == 0), in use (ref + pins >
  0: PRIMARY, never evicted, offloaded or moved);
- a block's level is >= its parent's: the tree's PRIMARY blocks are prefix-closed, the secondary and
  disk ones whole subtrees (dropping a block drops its subtree);
- slots are a permutation of range(num_slots) per level; holds == 0.
An evicted block moves down if its priority is >= offload_min_priority and the level below has room
(made the same way), else it is dropped. A candidate: cached, no hold, no child at its own level.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from kvcache.block import Block, CopyOp, Level
from kvcache.errors import KVCacheError, UnknownBlockError
from kvcache.events import MOVED, NO_EVENTS, REMOVED, STORED, EventSink
from kvcache.eviction import EvictionQueue
from kvcache.reuse_tree import ReuseTree

P, S, D = Level.PRIMARY, Level.SECONDARY, Level.DISK
# (disk slot, hash, parent hash or None for a root child, tokens, salt digest, priority)
DiskEntry = tuple[int, bytes, bytes | None, tuple[int, ...], bytes, int]


def _primary_candidate(b: Block) -> bool:
    return (b.level is P and b.hash is not None and b.ref + b.pins + b.holds == 0
            and b.primary_children == 0)


def _secondary_candidate(b: Block) -> bool:
    return b.level is S and b.hash is not None and b.holds == 0 and b.secondary_children == 0


def _disk_candidate(b: Block) -> bool:
    return b.level is D and b.hash is not None and b.holds == 0 and not b.children


CANDIDATES = (_primary_candidate, _secondary_candidate, _disk_candidate)  # indexed by Level


class BlockManager:
    def __init__(self, num_primary: int, num_secondary: int, num_disk: int = 0, *,
                 offload_min_priority: int) -> None:
        # ids 0..num_primary-1 start in primary slots 0.., then the secondary blocks, then the disk
        # ones: before any offload or onboard a primary block's id equals its slot.
        self.num_slots = (num_primary, num_secondary, num_disk)  # indexed by Level
        self.blocks: list[Block] = []
        for level, n in zip(Level, self.num_slots, strict=True):
            self.blocks += [Block(len(self.blocks) + j, level, j) for j in range(n)]
        self.free = tuple(deque(b for b in self.blocks if b.level is level) for level in Level)
        self.owners = tuple(list(f) for f in self.free)  # level -> slot -> the block in that slot
        self.tree = ReuseTree()
        seqs = itertools.count(1)  # one counter for every level's queue (see eviction.py)
        self.queues = tuple(EvictionQueue(n, seqs) for n in self.num_slots)
        self.offload_min_priority = offload_min_priority
        self.copies: list[CopyOp] = []  # pending, in order; drained by the facade after each call
        self.events: EventSink = NO_EVENTS  # tree changes for a router's index (kvcache/events.py)
        self.num_in_use = 0  # blocks with ref + pins > 0 (all primary)
        self.num_refs = self.num_pins = 0  # sums of every block's ref and pins (cheap health checks)
        self.num_reclaimable = 0  # primary tree blocks that are not busy
        self.clock = 0
        self.evictions = 0  # cached blocks that lost their slot at any level (moved down or dropped)
        self.moved = {(a, b): 0 for a in Level for b in Level if abs(a - b) == 1}  # blocks per tier move
        self.copied = {(P, S): 0, (S, P): 0, (P, P): 0, (S, S): 0}  # blocks copied per direction

    # ---- lookups
    def get(self, block_id: int) -> Block:
        """The allocated block `block_id` (UnknownBlockError if out of range or free)."""
        if not 0 <= block_id < len(self.blocks):
            raise UnknownBlockError(f"unknown block id {block_id} (valid ids: 0..{len(self.blocks) - 1})")
        b = self.blocks[block_id]
        if not b.in_use and b.hash is None:
            raise UnknownBlockError(f"block {block_id} is free: it holds no KV")
        return b

    def evictable_keeping(self, keep: list[Block]) -> int:
        """Primary blocks obtainable (free + reclaimable) while `keep` and its ancestors stay. Exact: a
        non-busy primary tree block outside that closure can be reclaimed by evicting leaves first."""
        lost, seen = 0, set()
        for b in keep:
            while b is not None and b.id not in seen and b.level is P and b.hash is not None and not b.busy:
                seen.add(b.id)
                lost += 1
                b = b.parent
        return len(self.free[P]) + self.num_reclaimable - lost

    # ---- references
    def acquire(self, b: Block, priority: int) -> None:
        assert b.level is P, b
        b.ref += 1
        self.num_refs += 1
        b.priority = priority
        self._became_used(b)

    def release(self, b: Block) -> None:
        b.ref -= 1
        self.num_refs -= 1
        self.clock += 1
        b.tick = self.clock
        self._became_idle(b)

    def pin(self, b: Block) -> None:
        assert b.level is P, b
        b.pins += 1
        self.num_pins += 1
        self._became_used(b)

    def unpin(self, b: Block) -> None:
        b.pins -= 1
        self.num_pins -= 1
        self._became_idle(b)

    def hold(self, b: Block) -> None:
        """Guard `b` against eviction until `unhold` (inside one public call)."""
        b.holds += 1

    def unhold(self, b: Block) -> None:
        b.holds -= 1
        if b.holds == 0:
            self._maybe_queue(b)

    def allocate(self, priority: int) -> Block:
        """A new private primary block with ref 1 (evicts a cached block if no block is free)."""
        self._primary_room()
        b = self.free[P].popleft()
        b.ref = 1
        self.num_refs += 1
        b.priority = priority
        b.busy = True  # private: no ancestors to update
        self.num_in_use += 1
        return b

    def copy(self, src: Block, dst: Block) -> None:
        """Copy src's whole slot into dst's slot (partial reuse)."""
        self.copies.append(CopyOp(src.level, src.slot, dst.level, dst.slot))
        self.copied[src.level, dst.level] += 1

    # ---- tree
    def insert(self, b: Block, block_hash: bytes, parent: Block | None, tokens: tuple[int, ...],
               salt_digest: bytes) -> None:
        """Put in-use private block `b` into the tree under `parent` (None: the root)."""
        assert b.in_use and b.hash is None and (parent is None or parent.level is P), (b, parent)
        self.tree.add(b, block_hash, parent, tokens, salt_digest)
        self.events.append((STORED, block_hash, P))
        if parent is not None:
            parent.children[b.id] = b
            parent.primary_children += 1
            parent.busy_children += 1
            self._update_busy(parent)

    def take_over(self, b: Block) -> None:
        """Remove unreferenced leaf `b` from the tree, making it private (partial reuse, no copy)."""
        assert not b.in_use and not b.children and b.level is P, b
        self._detach(b)

    def onboard(self, b: Block) -> None:
        """Move secondary tree block `b` (held by the caller, parent primary) to a primary slot."""
        assert b.level is S and b.holds > 0 and (b.parent is None or b.parent.level is P), b
        self._primary_room()
        self._move(b, P)

    def promote(self, b: Block) -> bool:
        """Move held disk tree block `b` to a secondary slot (evicting if need be); False (nothing
        changed) when every secondary block is held or has a secondary child."""
        assert b.level is D and b.holds > 0 and (b.parent is None or b.parent.level is not D), b
        if not self._make_room(S):
            return False
        self._move(b, S)
        return True

    def discard(self, b: Block) -> None:
        """Drop cached disk block `b` and its subtree (its file could not be read back)."""
        assert b.level is D and b.hash is not None and b.holds == 0, b
        self.evictions += 1
        self._drop(b)

    def restore_disk(self, entries: Iterable[DiskEntry]) -> list[int]:
        """Put blocks found on disk at start (first thing) in the tree, parents first, later ones more
        recent; skips a bad or taken slot, a known hash or a missing parent. Returns the slots restored."""
        base = self.num_slots[P] + self.num_slots[S]
        restored = []
        for slot, block_hash, parent_hash, tokens, salt_dig, priority in entries:
            parent = None if parent_hash is None else self.tree.by_hash.get(parent_hash)
            if not 0 <= slot < self.num_slots[D] or block_hash in self.tree.by_hash or \
                    (parent_hash is not None and parent is None):
                continue
            b = self.blocks[base + slot]
            assert b.level is D and b.slot == slot and b.hash is None, b  # untouched since construction
            self.tree.add(b, block_hash, parent, tokens, salt_dig)
            self.events.append((STORED, block_hash, D))
            if parent is not None:
                parent.children[b.id] = b
            self.clock += 1
            b.priority, b.tick = priority, self.clock
            restored.append(slot)
        self.free[D].clear()
        self.free[D].extend(b for b in self.blocks[base:] if b.hash is None)
        for b in self.blocks[base:]:
            self._maybe_queue(b)
        return restored

    def _became_used(self, b: Block) -> None:
        if b.ref + b.pins != 1:
            return
        self.num_in_use += 1
        if not b.busy:
            self._update_busy(b)

    def _became_idle(self, b: Block) -> None:
        if b.ref + b.pins != 0:
            return
        self.num_in_use -= 1
        if b.hash is None:
            b.busy = False
            self._free(b)
            return
        if b.busy_children == 0:
            self._update_busy(b)
            if b.primary_children == 0 and b.holds == 0:
                self.queues[P].push(b)  # a primary leaf (in use until now, so primary)

    def _update_busy(self, b: Block | None) -> None:
        """Recompute `busy` of b and, while it changes, of its ancestors."""
        while b is not None:
            busy = b.ref + b.pins > 0 or b.busy_children > 0
            if busy == b.busy:
                return
            b.busy = busy
            if b.hash is None:
                return
            if b.level is P:
                self.num_reclaimable += -1 if busy else 1
            b = b.parent
            if b is not None:
                b.busy_children += 1 if busy else -1

    def _maybe_queue(self, b: Block) -> None:
        if CANDIDATES[b.level](b):
            self.queues[b.level].push(b)

    def _primary_room(self) -> None:
        if not self._make_room(P):
            raise KVCacheError("internal: no evictable primary block although the capacity check passed")

    def _make_room(self, level: Level) -> bool:
        """True when `level` has a free block, after evicting a candidate if need be (moved one level
        down if its priority allows and room is made there the same way, else dropped)."""
        if self.free[level]:
            return True
        victim = self.queues[level].pop(CANDIDATES[level])
        if victim is None:
            return False
        self.evictions += 1
        below = level + 1
        if below < len(Level) and victim.priority >= self.offload_min_priority and self._make_room(Level(below)):
            self._move(victim, Level(below))
        else:
            self._drop(victim)
        return True

    def _move(self, b: Block, level: Level) -> None:
        """Swap cached block b with a free block of the neighbouring `level` (the caller made room)."""
        old, parent = b.level, b.parent
        if old is P:
            self.num_reclaimable -= 1  # b was a non-busy primary tree block (an eviction victim)
        self._swap_slots(b, self.free[level].popleft())
        self.moved[old, level] += 1
        self.events.append((MOVED, b.hash, level))
        if level is P and not b.busy:
            self.num_reclaimable += 1
        if parent is not None:
            self._count_child(parent, old, -1)
            self._count_child(parent, level, 1)
            self._maybe_queue(parent)
        self._maybe_queue(b)

    @staticmethod
    def _count_child(parent: Block, level: Level, delta: int) -> None:
        if level is P:
            parent.primary_children += delta
        elif level is S:
            parent.secondary_children += delta

    def _swap_slots(self, b: Block, spare: Block) -> None:
        """b and free block `spare` trade (level, slot); b's data is copied across."""
        self.copies.append(CopyOp(b.level, b.slot, spare.level, spare.slot))
        if (b.level, spare.level) in self.copied:
            self.copied[b.level, spare.level] += 1
        b.level, spare.level = spare.level, b.level
        b.slot, spare.slot = spare.slot, b.slot
        self.owners[b.level][b.slot] = b
        self.owners[spare.level][spare.slot] = spare
        self.free[spare.level].append(spare)

    def _drop(self, b: Block) -> None:
        """Remove cached block b and its subtree (farther from the GPU, unreferenced); free them."""
        for child in list(b.children.values()):
            assert child.level is not P and child.holds == 0, child
            self.evictions += 1
            self._drop(child)
        self._detach(b)
        self._free(b)

    def _detach(self, b: Block) -> None:
        """Take unreferenced childless tree block b out of the tree, fixing its parent's counters."""
        if b.level is P and not b.busy:
            self.num_reclaimable -= 1
        parent = b.parent
        self.events.append((REMOVED, b.hash, b.level))
        self.tree.remove(b)
        if parent is not None:
            del parent.children[b.id]
            self._count_child(parent, b.level, -1)
            self._maybe_queue(parent)

    def _free(self, b: Block) -> None:
        b.priority = 35
        b.tick = 0
        b.queue_seq = -1
        self.free[b.level].append(b)
