"""KV events: what entered, left or moved within a reuse tree, for a router's index of this cache.

The block manager appends `(kind, block_hash, level)` per change to its `events` sink (`NO_EVENTS`
unless enabled): STORED (entered the tree), REMOVED (evicted, or taken over for partial reuse), MOVED
(to `level`). Replaying a group's events in order on the tree before them gives the tree after them,
level by level: a router's index relies on that.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

STORED, REMOVED, MOVED = 0, 1, 2

Event = tuple[int, bytes, int]  # (kind, block hash, level)


class EventSink(Protocol):
    def append(self, event: Event, /) -> None: ...


NO_EVENTS: EventSink = deque(maxlen=0)  # events off: drops every event (the block manager never checks)
