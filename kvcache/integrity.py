"""A BlockManager's invariants: the full recomputation (O(blocks): tests, debug runs, idle engines)
and the cheap subset a busy engine checks periodically (`check_accounting`: O(blocks of live requests))."""

from __future__ import annotations

from collections import Counter

from kvcache.block import Block, Level
from kvcache.block_manager import CANDIDATES, BlockManager
from kvcache.errors import KVCacheError


def check_block_manager(bm: BlockManager, label: str) -> None:
    """Raise KVCacheError naming `label` and the block when an invariant is broken."""

    def fail(msg: str) -> None:
        raise KVCacheError(f"{label}: {msg}")

    for level in Level:
        slots = sorted(b.slot for b in bm.blocks if b.level is level)
        if slots != list(range(bm.num_slots[level])):
            fail(f"{level.name} slots are not a permutation of 0..{bm.num_slots[level] - 1}: {slots}")
        stray = [(slot, b.id) for slot, b in enumerate(bm.owners[level]) if (b.level, b.slot) != (level, slot)]
        if stray:
            fail(f"{level.name} slot owners are stale: (slot, block) {stray}")
        free = bm.free[level]
        if len({b.id for b in free}) != len(free) or any(b.level is not level for b in free):
            fail(f"{level.name} free list has duplicates or blocks of another level")
    free_ids = {b.id for lvl in Level for b in bm.free[lvl]}
    for b in bm.blocks:
        _check_block(b, b.id in free_ids, fail)
        if b.hash is not None:
            _check_tree_links(bm, b, fail)
    in_use = sum(b.in_use for b in bm.blocks)
    if in_use != bm.num_in_use:
        fail(f"num_in_use={bm.num_in_use} but {in_use} blocks are in use")
    reclaimable = sum(b.level is Level.PRIMARY and b.hash is not None and not b.busy for b in bm.blocks)
    if reclaimable != bm.num_reclaimable:
        fail(f"num_reclaimable={bm.num_reclaimable} but {reclaimable} primary tree blocks are not busy")
    _check_queues(bm, fail)


def check_request_refs(bm: BlockManager, label: str, request_blocks: list[list[Block | None]]) -> None:
    """Each ref count equals the live requests' references, and no recorded copy is left unexecuted."""
    if bm.copies:
        raise KVCacheError(f"{label}: {len(bm.copies)} copies were never executed")
    refs = Counter(b.id for blocks in request_blocks for b in blocks if b is not None)
    for b in bm.blocks:
        if b.ref != refs[b.id]:
            raise KVCacheError(f"{label}: block {b.id} has ref={b.ref} but {refs[b.id]} request references")
    total_refs, pins = sum(b.ref for b in bm.blocks), sum(b.pins for b in bm.blocks)
    if (total_refs, pins) != (bm.num_refs, bm.num_pins):
        raise KVCacheError(f"{label}: num_refs={bm.num_refs}, num_pins={bm.num_pins} but the blocks hold "
                           f"{total_refs} refs, {pins} pins")


def check_accounting(bm: BlockManager, label: str, request_blocks: list[list[Block | None]]) -> None:
    """Request references equal the live requests', and the counters fit the pool's size."""
    refs = sum(b is not None for blocks in request_blocks for b in blocks)
    if refs != bm.num_refs:
        raise KVCacheError(f"{label}: blocks count {bm.num_refs} request references, live requests hold {refs}")
    (num_p, num_s, num_d), (free_p, free_s, free_d) = bm.num_slots, (len(f) for f in bm.free)
    in_use = bm.num_in_use
    problems = [
        (bm.num_pins < 0, f"num_pins={bm.num_pins} is negative"),
        (not 0 <= in_use <= bm.num_refs + bm.num_pins,
         f"num_in_use={in_use} outside [0, refs {bm.num_refs} + pins {bm.num_pins}]"),
        (free_p + in_use > num_p, f"primary: {free_p} free + {in_use} in use > {num_p} slots"),
        (free_s > num_s, f"secondary: {free_s} free > {num_s} slots"),
        (free_d > num_d, f"disk: {free_d} free > {num_d} slots"),
        (len(bm.tree) > num_p + num_s + num_d - free_p - free_s - free_d,
         f"the reuse tree holds {len(bm.tree)} blocks but only "
         f"{num_p + num_s + num_d - free_p - free_s - free_d} are not free"),
        (not 0 <= bm.num_reclaimable <= num_p - free_p - in_use,
         f"num_reclaimable={bm.num_reclaimable} outside [0, cached primary {num_p - free_p - in_use}]"),
    ]
    for broken, message in problems:
        if broken:
            raise KVCacheError(f"{label}: {message}")


def _check_block(b: Block, is_free: bool, fail) -> None:
    if b.holds:
        fail(f"block {b.id} still has holds={b.holds} between calls")
    states = is_free + (b.hash is not None and not b.in_use) + b.in_use
    if states != 1:
        fail(f"block {b.id} is in {states} states (free={is_free}, cached={b.hash is not None}, "
             f"ref={b.ref}, pins={b.pins})")
    if b.ref < 0 or b.pins < 0:
        fail(f"block {b.id} has a negative count (ref={b.ref}, pins={b.pins})")
    if b.in_use and b.level is not Level.PRIMARY:
        fail(f"block {b.id} is in use but in the {b.level.name} pool")
    if is_free and (b.children or b.busy or b.parent is not None):
        fail(f"free block {b.id} still has tree links")
    if b.hash is None and b.in_use and (b.children or b.parent is not None):
        fail(f"private block {b.id} has tree links")


def _check_tree_links(bm: BlockManager, b: Block, fail) -> None:
    if bm.tree.by_hash.get(b.hash) is not b:
        fail(f"block {b.id} is not indexed under its hash")
    p = b.parent
    if p is not None:
        if p.hash is None or p.children.get(b.id) is not b:
            fail(f"block {b.id}'s parent {p.id} is not in the tree or does not list it")
        if b.level < p.level:
            fail(f"{b.level.name.lower()} block {b.id} has a {p.level.name} parent {p.id} (levels go back "
                 f"up the tree)")
    for c in b.children.values():
        if c.parent is not b:
            fail(f"block {b.id} lists child {c.id} whose parent is another block")
    primary_children = sum(c.level is Level.PRIMARY for c in b.children.values())
    secondary_children = sum(c.level is Level.SECONDARY for c in b.children.values())
    busy_children = sum(c.busy for c in b.children.values())
    if (primary_children, busy_children) != (b.primary_children, b.busy_children):
        fail(f"block {b.id} counts {b.primary_children} primary / {b.busy_children} busy children, "
             f"has {primary_children} / {busy_children}")
    if secondary_children != b.secondary_children:
        fail(f"block {b.id} counts {b.secondary_children} secondary children, has {secondary_children}")
    if b.busy != (b.in_use or busy_children > 0):
        fail(f"block {b.id} busy={b.busy} is stale")


def _check_queues(bm: BlockManager, fail) -> None:
    for level, is_candidate in zip(Level, CANDIDATES, strict=True):
        live = bm.queues[level].live_entries()
        missing = [b.id for b in bm.blocks if is_candidate(b) and b.id not in live]
        if missing:
            fail(f"eviction candidates {missing} of the {level.name} level are not queued")
    if len(bm.tree) != sum(b.hash is not None for b in bm.blocks):
        fail("the hash index and the blocks' tree membership disagree")
