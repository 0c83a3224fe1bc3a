"""Carrying out checked plans: capacity check, admission of one group, onboarding for ensure_primary.

Order matters for atomicity and safety: capacity is checked for every group before any state change;
blocks that must survive (reused chain, partial-reuse source, blocks to onboard and their anchors)
are acquired or held before the first allocation, because an allocation may evict.
"""

from __future__ import annotations

from kvcache.block import Block, Level
from kvcache.block_manager import BlockManager
from kvcache.errors import OutOfBlocksError
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
    held = [b for b in gp.chain if b.level is Level.SECONDARY]
    held += [gp.partial] if gp.partial is not None else []
    for b in held:
        bm.hold(b)
    blocks = []
    for b in gp.chain:  # primary prefix first (no allocation), then onboards in order
        if b.level is Level.SECONDARY:
            bm.onboard(b)
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


def make_primary(bm: BlockManager, window: int, blocks: list[Block]) -> None:
    """Onboard the non-primary blocks of `blocks` and their secondary ancestors, root first."""
    onboard: list[Block] = []
    keep = [b for b in blocks if b.level is Level.PRIMARY]
    seen: set[int] = set()
    for b in blocks:
        path = []
        while b is not None and b.level is Level.SECONDARY and b.id not in seen:
            seen.add(b.id)
            path.append(b)
            b = b.parent
        if path and b is not None and b.level is Level.PRIMARY:
            keep.append(b)
        onboard += reversed(path)
    if not onboard:
        return
    check_capacity(f"onboarding {len(onboard)} blocks", [(bm, window, len(onboard), keep)])
    held = keep + onboard
    for b in held:
        bm.hold(b)
    for b in onboard:
        bm.onboard(b)
    for b in held:
        bm.unhold(b)
