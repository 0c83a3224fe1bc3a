"""Blocks of one window group at both levels: free lists, ref counts and pins, the reuse tree,
eviction (priority, then LRU, leaves only), offload of evicted blocks to the secondary level, onboard.
Pure Python, no torch: data moves are recorded as `CopyOp`s in `copies`, which the pool executes.

Invariants (checked by `kvcache.integrity.check_block_manager`), between public calls:
- each block is exactly one of: free (in its level's free list), cached (in the tree, ref == pins
  == 0), in use (ref + pins > 0); an in-use block is PRIMARY and never evicted, offloaded or moved;
- the PRIMARY level is prefix-closed: a primary tree block's parent is primary, so the secondary
  blocks of the tree are whole subtrees (dropping a primary block drops its secondary subtree);
- slots are a permutation of range(num_slots) per level; holds == 0.
"""

from __future__ import annotations

import itertools
from collections import deque

from kvcache.block import Block, CopyOp, Level
from kvcache.errors import KVCacheError, UnknownBlockError
from kvcache.events import MOVED, NO_EVENTS, REMOVED, STORED, EventSink
from kvcache.eviction import EvictionQueue
from kvcache.reuse_tree import ReuseTree

P, S = Level.PRIMARY, Level.SECONDARY


def _primary_candidate(b: Block) -> bool:
    return (b.level is P and b.hash is not None and b.ref + b.pins + b.holds == 0
            and b.primary_children == 0)


def _secondary_candidate(b: Block) -> bool:
    return b.level is S and b.hash is not None and b.holds == 0 and not b.children


class BlockManager:
    def __init__(self, num_primary: int, num_secondary: int, *, offload_min_priority: int) -> None:
        # ids 0..num_primary-1 start in primary slots 0.., the rest in secondary slots 0..: before any
        # offload or onboard a primary block's id equals its slot.
        self.blocks = [Block(i, P, i) for i in range(num_primary)]
        self.blocks += [Block(num_primary + j, S, j) for j in range(num_secondary)]
        self.num_slots = (num_primary, num_secondary)
        self.free = (deque(self.blocks[:num_primary]), deque(self.blocks[num_primary:]))
        self.tree = ReuseTree()
        seqs = itertools.count(1)  # one counter for both levels' queues (see eviction.py)
        self.queues = (EvictionQueue(num_primary, seqs), EvictionQueue(num_secondary, seqs))
        self.offload_min_priority = offload_min_priority
        self.copies: list[CopyOp] = []  # pending, in order; drained by the facade after each call
        self.events: EventSink = NO_EVENTS  # tree changes for a router's index (kvcache/events.py)
        self.num_in_use = 0  # blocks with ref + pins > 0 (all primary)
        self.num_refs = self.num_pins = 0  # sums of every block's ref and pins (cheap health checks)
        self.num_reclaimable = 0  # primary tree blocks that are not busy
        self.clock = 0
        self.evictions = self.offloads = self.onboards = 0
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
        """Primary blocks obtainable (free + reclaimable by eviction) while every block of `keep` and
        its ancestors stays. Exact: a non-busy primary tree block outside that closure can be
        reclaimed by evicting leaves first."""
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
        if b.ref + b.pins == 1:
            self._became_used(b)

    def release(self, b: Block) -> None:
        b.ref -= 1
        self.num_refs -= 1
        self.clock += 1
        b.tick = self.clock
        if b.ref + b.pins == 0:
            self._became_idle(b)

    def pin(self, b: Block) -> None:
        assert b.level is P, b
        b.pins += 1
        self.num_pins += 1
        if b.ref + b.pins == 1:
            self._became_used(b)

    def unpin(self, b: Block) -> None:
        b.pins -= 1
        self.num_pins -= 1
        if b.ref + b.pins == 0:
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
        b = self.free[P].popleft() if self.free[P] else self._take_primary()
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
        spare = self._take_primary()
        self._swap_slots(b, spare)
        self.free[S].append(spare)
        self.onboards += 1
        self.events.append((MOVED, b.hash, P))
        if b.parent is not None:
            b.parent.primary_children += 1
        if not b.busy:
            self.num_reclaimable += 1

    # ---- internals
    def _became_used(self, b: Block) -> None:
        self.num_in_use += 1
        if not b.busy:
            self._update_busy(b)

    def _became_idle(self, b: Block) -> None:
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
        if _primary_candidate(b):
            self.queues[P].push(b)
        elif _secondary_candidate(b):
            self.queues[S].push(b)

    def _take_primary(self) -> Block:
        if not self.free[P]:
            self._evict_primary()
        return self.free[P].popleft()

    def _evict_primary(self) -> None:
        victim = self.queues[P].pop(_primary_candidate)
        if victim is None:
            raise KVCacheError("internal: no evictable primary block although the capacity check passed")
        self.evictions += 1
        if victim.priority >= self.offload_min_priority and self._secondary_room():
            self._offload(victim)
        else:
            self._drop(victim)

    def _secondary_room(self) -> bool:
        """True when a secondary block is free, or one could be freed by evicting a secondary leaf."""
        if self.free[S]:
            return True
        if self.num_slots[S] == 0:
            return False
        leaf = self.queues[S].pop(_secondary_candidate)
        if leaf is None:
            return False
        self.evictions += 1
        self._drop(leaf)
        return True

    def _offload(self, b: Block) -> None:
        spare = self.free[S].popleft()
        self._swap_slots(b, spare)
        self.free[P].append(spare)
        self.offloads += 1
        self.events.append((MOVED, b.hash, S))
        self.num_reclaimable -= 1  # b was a non-busy primary tree block
        parent = b.parent
        if parent is not None:
            parent.primary_children -= 1
            self._maybe_queue(parent)
        self._maybe_queue(b)

    def _swap_slots(self, b: Block, spare: Block) -> None:
        """b takes spare's (level, slot) and spare takes b's; b's data is copied across."""
        self.copies.append(CopyOp(b.level, b.slot, spare.level, spare.slot))
        self.copied[b.level, spare.level] += 1
        b.level, spare.level = spare.level, b.level
        b.slot, spare.slot = spare.slot, b.slot

    def _drop(self, b: Block) -> None:
        """Remove cached block b and its (necessarily secondary, unreferenced) subtree; free them."""
        for child in list(b.children.values()):
            assert child.level is S and child.holds == 0, child
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
            if b.level is P:
                parent.primary_children -= 1
            self._maybe_queue(parent)

    def _free(self, b: Block) -> None:
        b.priority = 35
        b.tick = 0
        b.queue_seq = -1
        self.free[b.level].append(b)
