"""Counters of the KV cache manager, exported as Prometheus metrics by the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVCacheStats:
    """Cumulative counters (all groups together) and current block counts.

    evictions: cached blocks that lost their slot (moved a level down or dropped), at any level.
    offloads / onboards: blocks moved primary -> secondary / secondary -> primary.
    bytes_offloaded / bytes_onboarded / bytes_copied_primary: bytes copied primary -> secondary,
    secondary -> primary (onboards and partial-reuse copies from the host pool), primary -> primary.
    disk_offloads / disk_onboards: blocks moved secondary -> disk (writes queued) / disk -> secondary
    (disk hits, read and checked); disk_bytes_written / disk_bytes_read: their payload bytes that
    reached a file / were read back; disk_dropped: disk blocks dropped because their bytes were lost,
    by reason (corrupt, truncated, stale, format, missing, timeout, io_error: the file failed on read;
    queue_full: the write queue refused it); disk_write_errors: writes that failed (the block is
    dropped when read); disk_queued_bytes: bytes waiting for their write now; disk_restored: blocks
    found on disk at start.
    blocks[(window, "primary"|"secondary"|"disk", "free"|"cached"|"in_use")]: current number of
    blocks ("disk" only with a disk tier).
    """

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    offloads: int = 0
    onboards: int = 0
    bytes_offloaded: int = 0
    bytes_onboarded: int = 0
    bytes_copied_primary: int = 0
    disk_offloads: int = 0
    disk_onboards: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_write_errors: int = 0
    disk_queued_bytes: int = 0
    disk_restored: int = 0
    disk_dropped: dict[str, int] = field(default_factory=dict)
    blocks: dict[tuple[int, str, str], int] = field(default_factory=dict)
