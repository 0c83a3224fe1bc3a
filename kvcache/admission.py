"""Carrying out checked plans: capacity check, admission of one group, onboarding for ensure_primary.

Order matters for atomicity and safety: capacity is checked for every group before any state change;
blocks that must survive (reused chain, partial-reuse source, blocks to onboard and their anchors)
are acquired or held before the first allocation, because an allocation may evict.

A disk block comes up one level at a time: promoted to the secondary (host) level, then onboarded
like any host block (`_bring_up`); the facade has read and checked its file before
(kvcache/disk_tier.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.block import Block, Level
from kvcache.block_manager import BlockManager
from kvcache.errors import KVCacheError, OutOfBlocksError
from kvcache.matching import GroupPlan


def check_capacity(what: str, needs: list[tuple[BlockManager, int, int, list[Block]]]) -> None:
    """OutOfBlocksError if some (block manager, window, primary blocks needed, blocks to keep) cannot
    be served. Call it for every group before changing anything."""
    for bm, window, need, keep in needs:
        if need > 0:
            available = bm.evictable_keeping(keep)
            if need > available:
                raise OutOfBlocksError(f"{what}: needs {need} primary blocks in window {window}, "
                                       f"only {available} free or evictable")


def execute_plan(bm: BlockManager, gp: GroupPlan, priority: int, *, take_over: bool) -> list[Block]:
    """Carry out a checked admission plan of one group; returns the request's blocks."""
    held = [b for b in gp.chain if b.level is not Level.PRIMARY]
    held += [gp.partial] if gp.partial is not None else []
    for b in held:
        bm.hold(b)
    blocks = []
    for b in gp.chain:  # the primary prefix first: in use before an onboard may evict
        if b.level is not Level.PRIMARY:
            break
        bm.acquire(b, priority)
        blocks.append(b)
    rest = gp.chain[len(blocks):]
    _bring_up(bm, rest)
    for b in rest:
        bm.acquire(b, priority)
        blocks.append(b)
    new = gp.new_blocks
    if gp.partial is not None:
        blocks.append(_reuse_partial(bm, gp.partial, priority, take_over))
        new -= 0 if take_over else 1
    blocks += [bm.allocate(priority) for _ in range(new)]
    for b in held:
        bm.unhold(b)
    return blocks


def _bring_up(bm: BlockManager, blocks: list[Block]) -> None:
    """Make held non-primary blocks primary; each comes after its parent, whose level is <= its own.
    The host blocks first (freeing their host slots), then as many disk blocks as the host level can
    take at once are promoted, so their copies run as one batch; the rest come up one by one, each
    through the host slot the one before it freed. A late promotion cannot fail: by then no
    secondary block is held, so the secondary level has a free block or a candidate."""
    disk = [b for b in blocks if b.level is Level.DISK]
    for b in blocks:
        if b.level is Level.SECONDARY:
            bm.onboard(b)  # its parent is primary: a host block's parent is never on disk
    # while the host level has room for them all (one batch of copies), leaving it one block for
    # the primary blocks their onboards evict, which would otherwise be dropped
    for b in disk[:bm.num_slots[Level.SECONDARY] - 1]:
        if not bm.promote(b):
            break
    for b in disk:
        if b.level is Level.DISK and not bm.promote(b):
            raise KVCacheError(f"internal: no secondary block to promote disk block {b.id} into")
        bm.onboard(b)


def _reuse_partial(bm: BlockManager, src: Block, priority: int, take_over: bool) -> Block:
    if take_over:
        if src.level is Level.SECONDARY:
            bm.onboard(src)
        bm.take_over(src)
        bm.acquire(src, priority)
        return src
    dst = bm.allocate(priority)
    bm.copy(src, dst)
    return dst


def onboard_closure(blocks: list[Block]) -> tuple[list[Block], list[Block]]:
    """(the non-primary blocks of `blocks` and their non-primary ancestors, each path root first;
    the primary blocks that must stay: those of `blocks` and the primary parents of those paths)."""
    onboard: list[Block] = []
    keep = [b for b in blocks if b.level is Level.PRIMARY]
    seen: set[int] = set()
    for b in blocks:
        path = []
        while b is not None and b.level is not Level.PRIMARY and b.id not in seen:
            seen.add(b.id)
            path.append(b)
            b = b.parent
        if path and b is not None and b.level is Level.PRIMARY:
            keep.append(b)
        onboard += reversed(path)
    return onboard, keep


def make_primary(bm: BlockManager, window: int, blocks: list[Block],
                 check_files: Callable[[list[Block]], None]) -> None:
    """Onboard the non-primary blocks of `blocks` and their non-primary ancestors, root first;
    OutOfBlocksError before any change. `check_files(onboard)` runs after the capacity check, before
    anything moves: it reads the disk blocks' files (and raises if one failed)."""
    onboard, keep = onboard_closure(blocks)
    if not onboard:
        return
    check_capacity(f"onboarding {len(onboard)} blocks", [(bm, window, len(onboard), keep)])
    check_files(onboard)
    held = keep + onboard
    for b in held:
        bm.hold(b)
    _bring_up(bm, onboard)
    for b in held:
        bm.unhold(b)
