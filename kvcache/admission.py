"""Carrying out checked plans: capacity check, admission of one group, onboarding for ensure_primary.

Capacity is checked for every group before any change; blocks that must survive (reused chain,
partial-reuse source, blocks to onboard and their anchors) are acquired or held before the first
allocation, which may evict. A disk block comes up via the host level (`_bring_up`), its file
checked before by the facade (disk_tier.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.block import Block, Level
from kvcache.block_manager import BlockManager
from kvcache.errors import KVCacheError, OutOfBlocksError
from kvcache.matching import GroupPlan


def check_capacity(what: str, needs: list[tuple[BlockManager, int, int, list[Block]]]) -> None:
    """OutOfBlocksError if some (block manager, window, primary blocks needed, blocks to keep) cannot
    be served (call it for every group before any change)."""
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
    """Make held non-primary blocks (each after its parent) primary: host blocks, then disk blocks in
    one batch as far as the host level has room, the rest one by one (then no host block is held)."""
    disk = [b for b in blocks if b.level is Level.DISK]
    for b in blocks:
        if b.level is Level.SECONDARY:
            bm.onboard(b)  # its parent is primary: a host block's parent is never on disk
    # leave the host level one block for the primary blocks their onboards evict (else dropped)
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
    """(non-primary `blocks` and their non-primary ancestors, each path root first; the primary blocks
    that must stay: those of `blocks` and the paths' primary parents)."""
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
    """Onboard `blocks` and their ancestors (OutOfBlocksError first); `check_files(onboard)` reads the
    disk files after the capacity check, before anything moves."""
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
