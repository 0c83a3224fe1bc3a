"""Eviction order for one level: lowest priority first, least recently used within a priority.

A heap of (priority, tick, seq, block) with lazy deletion: an entry is live only while
`block.queue_seq == seq` and `is_candidate(block)` holds; `pop` skips the others, and the heap is
rebuilt when stale entries dominate (size O(blocks)). A block manager's queues (one per level) share
the `seq` counter: a stale entry in one queue must never carry the seq of the block's live entry in
another (popping it would drop the block from the queue it is in).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from kvcache.block import Block


class EvictionQueue:
    def __init__(self, capacity: int, seqs: Iterator[int]) -> None:
        """`seqs`: the counter shared with the other queues the same blocks can be in."""
        self._heap: list[tuple[int, int, int, Block]] = []
        self._seqs = seqs
        self._compact_at = 4 * capacity + 64

    def push(self, block: Block) -> None:
        """(Re)queue `block` with its current priority and tick; older entries of it become stale."""
        seq = next(self._seqs)
        block.queue_seq = seq
        heapq.heappush(self._heap, (block.priority, block.tick, seq, block))
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
