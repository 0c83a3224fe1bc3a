"""Carrying out checked plans: capacity check, admission of one group, onboarding for ensure_primary.

Order matters for atomicity and safety: capacity is checked for every group before any state change;
blocks that must survive (reused chain, partial-reuse source, blocks to onboard and their anchors)
are acquired or held before the first allocation, because an allocation may evict.

A disk block comes up one level at a time: promoted to the secondary (host) level, then onboarded
like any host block. The facade has read and checked its file before (kvcache/disk_tier.py). As
many disk blocks as the host level can take at once are promoted first, so their copies run as one
batch; any left come up one by one, each freeing its host slot for the next.
"""

from __future__ import annotations

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
    _promote_while_room(bm, gp.disk_blocks())
    blocks = []
    for b in gp.chain:  # primary prefix first (no allocation), then onboards in order
        _bring_up(bm, b)
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


def _promote_while_room(bm: BlockManager, disk: list[Block]) -> None:
    """Promote held disk blocks (parents first) while the secondary level has room for them all."""
    for b in disk:
        if not bm.promote(b):
            return


def _bring_up(bm: BlockManager, b: Block) -> None:
    """Make held block `b` (its parent primary) primary. A disk block's promotion cannot fail here:
    no secondary block is held any more (those before it in the plan are primary now), so the
    secondary level has a free block or a candidate."""
    if b.level is Level.DISK and not bm.promote(b):
        raise KVCacheError(f"internal: no secondary block to promote disk block {b.id} into")
    if b.level is Level.SECONDARY:
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


def make_primary(bm: BlockManager, window: int, blocks: list[Block]) -> None:
    """Onboard the non-primary blocks of `blocks` and their non-primary ancestors, root first (the
    facade has checked the files of the disk ones). OutOfBlocksError before any change when the
    primary level cannot take them; when the secondary level cannot relay the disk ones (it is
    full of held blocks of other paths), OutOfBlocksError after the blocks before them came up."""
    onboard, keep = onboard_closure(blocks)
    if not onboard:
        return
    check_capacity(f"onboarding {len(onboard)} blocks", [(bm, window, len(onboard), keep)])
    held = keep + onboard
    for b in held:
        bm.hold(b)
    try:
        _promote_while_room(bm, [b for b in onboard if b.level is Level.DISK])
        for b in onboard:
            if b.level is Level.DISK and not bm.promote(b):
                raise OutOfBlocksError(f"onboarding {len(onboard)} blocks in window {window}: the host "
                                       f"tier has no room to bring disk block {b.id} up")
            if b.level is Level.SECONDARY:
                bm.onboard(b)
    finally:
        for b in held:
            bm.unhold(b)
