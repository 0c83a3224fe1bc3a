"""KV events: what entered, left or moved within a reuse tree, for a router's index of this cache.

The block manager appends one small tuple per change to its `events` sink, on the engine thread:

    (STORED, block_hash, level)    a block entered the reuse tree (always at the PRIMARY level)
    (REMOVED, block_hash, level)   a block left it (evicted, or taken over for partial reuse)
    (MOVED, block_hash, level)     a cached block moved to `level` (offload: SECONDARY, onboard: PRIMARY)

The sink is `NO_EVENTS` (a null object that drops them) unless the owner enables events; the
KVCacheManager then drains them per window group (`KVCacheManager.drain_events`). Replaying a group's
events, in order, on the tree's content before them gives the tree's content after them, level by
level: that is what a router's index relies on.
"""

from __future__ import annotations

from typing import Protocol

STORED, REMOVED, MOVED = 0, 1, 2

Event = tuple[int, bytes, int]  # (kind, block hash, level)


class EventSink(Protocol):
    def append(self, event: Event, /) -> None: ...


class _NoEvents:
    """Events off: drops every event (the block manager never checks whether they are on)."""

    def append(self, event: Event, /) -> None:
        return None


NO_EVENTS: EventSink = _NoEvents()
