"""Counters of the KV cache manager (cumulative, all window groups), exported as Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVCacheStats:

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0  # cached blocks that lost their slot (moved a level down or dropped), at any level
    offloads: int = 0  # blocks moved primary -> secondary
    onboards: int = 0  # blocks moved secondary -> primary
    bytes_offloaded: int = 0  # bytes copied primary -> secondary
    bytes_onboarded: int = 0  # bytes copied secondary -> primary (onboards, partial-reuse copies from the host)
    bytes_copied_primary: int = 0  # bytes copied primary -> primary
    disk_offloads: int = 0  # blocks moved secondary -> disk (writes queued)
    disk_onboards: int = 0  # blocks moved disk -> secondary (disk hits, read and checked)
    disk_bytes_written: int = 0  # payload bytes that reached a file
    disk_bytes_read: int = 0  # payload bytes read back
    disk_write_errors: int = 0  # writes that failed (the block is dropped when read)
    disk_queued_bytes: int = 0  # bytes waiting for their write now
    disk_restored: int = 0  # blocks found on disk at start
    # disk blocks dropped because their bytes were lost, by reason (corrupt, truncated, stale, format,
    # missing, timeout, io_error: the file failed on read; queue_full: the write queue refused it)
    disk_dropped: dict[str, int] = field(default_factory=dict)
    # (window, "primary"|"secondary"|"disk", "free"|"cached"|"in_use") -> blocks now ("disk": with a disk tier)
    blocks: dict[tuple[int, str, str], int] = field(default_factory=dict)
