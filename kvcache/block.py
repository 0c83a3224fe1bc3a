"""One KV block (pure Python): `tokens_per_block` tokens of every layer of one window group, a stable
id and a current (level, slot). Blocks move between neighbouring levels: primary <-> host <-> disk.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Level(enum.IntEnum):
    PRIMARY = 0  # the device pool (GPU; CPU on machines without one)
    SECONDARY = 1  # the host pool (pinned when CUDA is present)
    DISK = 2  # the disk tier: one file per block in a local directory (kvcache/disk_store.py)


class CopyOp(NamedTuple):
    """Copy one whole slot: (src_level, src_slot) -> (dst_level, dst_slot). Executed by the pool."""

    src_level: Level
    src_slot: int
    dst_level: Level
    dst_slot: int


class Block:
    """State of one block, mutated only by `BlockManager`. `busy`: it or a tree descendant is in use
    (a primary tree block that is not busy can be reclaimed by evicting leaves)."""

    __slots__ = ("id", "level", "slot", "ref", "pins", "holds", "hash", "parent", "children", "tokens",
                 "priority", "tick", "busy", "busy_children", "primary_children",
                 "secondary_children", "queue_seq")

    def __init__(self, block_id: int, level: Level, slot: int) -> None:
        self.id = block_id
        self.level = level
        self.slot = slot
        self.ref = 0  # number of request references
        self.pins = 0  # pins (transfers, leases); count as references
        self.holds = 0  # transient guards inside one public call; 0 between calls
        self.hash: bytes | None = None  # set while the block is in the reuse tree
        self.parent: Block | None = None  # tree parent (None: a root child, or not in the tree)
        self.children: dict[int, Block] = {}  # tree children by block id
        self.tokens: tuple[int, ...] = ()  # the block's token ids while in the tree (partial reuse)
        self.priority = 35  # retention priority 0..100 (TensorRT-LLM's default 35)
        self.tick = 0  # last-use time, for LRU within a priority
        self.busy = False
        self.busy_children = 0  # children whose `busy` is True (they are all PRIMARY)
        self.primary_children = 0  # children at the PRIMARY level
        self.secondary_children = 0  # children at the SECONDARY level
        self.queue_seq = -1  # sequence number of this block's live eviction-queue entry, -1 if none

    @property
    def in_use(self) -> bool:
        return self.ref + self.pins > 0

    def __repr__(self) -> str:
        return (f"Block(id={self.id}, {self.level.name.lower()}:{self.slot}, ref={self.ref}, "
                f"pins={self.pins}, cached={self.hash is not None})")
