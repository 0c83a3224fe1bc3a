"""Eviction order for one level: lowest priority first, least recently used within a priority.

A binary heap of (priority, tick, seq, block) entries with lazy deletion: pushing a block again, or
the block leaving the candidate set, makes older entries stale; `pop` skips stale entries (an entry is
live only while `block.queue_seq == seq` and the caller's `is_candidate(block)` holds). The heap is
rebuilt from live entries when stale ones dominate, so its size stays O(number of blocks).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvcache.block import Block


class EvictionQueue:
    def __init__(self, capacity: int) -> None:
        self._heap: list[tuple[int, int, int, Block]] = []
        self._seq = 0
        self._compact_at = 4 * capacity + 64

    def push(self, block: Block) -> None:
        """(Re)queue `block` with its current priority and tick; older entries of it become stale."""
        self._seq += 1
        block.queue_seq = self._seq
        heapq.heappush(self._heap, (block.priority, block.tick, self._seq, block))
        if len(self._heap) > self._compact_at:
            self._heap = [e for e in self._heap if e[3].queue_seq == e[2]]
            heapq.heapify(self._heap)

    def pop(self, is_candidate: Callable[[Block], bool]) -> Block | None:
        """Remove and return the first live candidate, or None when there is none."""
        heap = self._heap
        while heap:
            _, _, seq, block = heapq.heappop(heap)
            if block.queue_seq == seq:
                block.queue_seq = -1
                if is_candidate(block):
                    return block
        return None

    def live_entries(self) -> set[int]:
        """Ids of blocks with a live entry (for integrity checks)."""
        return {b.id for _, _, seq, b in self._heap if b.queue_seq == seq}

    def __len__(self) -> int:
        return len(self._heap)
