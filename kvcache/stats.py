"""Counters of the KV cache manager, exported as Prometheus metrics by the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVCacheStats:
    """Cumulative counters (all groups together) and current block counts.

    evictions: cached blocks that lost their slot (offloaded or dropped), at either level.
    offloads / onboards: blocks moved primary -> secondary / secondary -> primary.
    bytes_offloaded / bytes_onboarded / bytes_copied_primary: bytes copied primary -> secondary,
    secondary -> primary (onboards and partial-reuse copies from the host pool), primary -> primary.
    blocks[(window, "primary"|"secondary", "free"|"cached"|"in_use")]: current number of blocks.
    """

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    offloads: int = 0
    onboards: int = 0
    bytes_offloaded: int = 0
    bytes_onboarded: int = 0
    bytes_copied_primary: int = 0
    blocks: dict[tuple[int, str, str], int] = field(default_factory=dict)
