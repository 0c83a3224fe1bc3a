"""Reused block-sized buffers for the disk tier's reads and writes (no torch).

A fresh 4 MiB buffer per block costs its page faults: on a 512 MiB hit as long as the copies
themselves. So read payloads and the copies of evicted host rows queued for writing live in buffers
taken from here and given back once used; a given-back buffer keeps its pages. `reserve` fills the
pool when the tier opens, so the first large hit does not pay the page faults on its own time
(docs/BENCHMARKS.md "Disk tier, engine level").

Ownership is strict: a buffer is given back exactly once, by its last user, and never touched after.
- a write's buffer: by the writer thread once it wrote (or skipped) it; by `DiskStore.write` when a
  newer write of the slot supersedes it before a writer picked it up; by the caller when refused;
- a read's buffer: by the reader on a failed check; else by whoever staged it, after copying it into
  host rows or when forgetting it (kvcache/disk_pool.py, kvcache/disk_mirror.py).
A buffer that is simply dropped is freed by the garbage collector: only a give-back can be unsafe.
"""

from __future__ import annotations

import threading


class BufferPool:
    def __init__(self, max_free_bytes: int) -> None:
        """Keep at most `max_free_bytes` of given-back buffers (the rest go to the garbage collector)."""
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of `nbytes` (its contents are whatever its last user left)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray | memoryview) -> None:
        """Hand back a buffer (or a view of all of one) that nothing uses any more; anything else
        (bytes, a view of part of a buffer) is left to the garbage collector."""
        if isinstance(buf, memoryview):
            whole = buf.obj
            if not isinstance(whole, bytearray) or buf.nbytes != len(whole):
                return
            buf = whole
        if not isinstance(buf, bytearray):
            return
        with self._lock:
            if self._free_bytes + len(buf) <= self.max_free_bytes:
                self._free.setdefault(len(buf), []).append(buf)
                self._free_bytes += len(buf)

    def reserve(self, nbytes: int, count: int) -> int:
        """Put up to `count` fresh buffers of `nbytes` in the pool, their pages touched now, within
        `max_free_bytes`; returns how many."""
        made = 0
        while made < count:
            with self._lock:
                if self._free_bytes + nbytes > self.max_free_bytes:
                    break
                self._free_bytes += nbytes  # counted before the allocation: a concurrent give sees it
            buf = bytearray(nbytes)  # zero-filled: every page faulted in here
            with self._lock:
                self._free.setdefault(nbytes, []).append(buf)
            made += 1
        return made

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
