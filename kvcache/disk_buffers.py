"""Reused block-sized buffers for the disk tier's reads and writes (no torch).

A fresh 4 MiB buffer per block costs page faults: on a 512 MiB hit as long as the copies. So read
payloads and queued writes use buffers from here, given back (pages kept) once used; `reserve` fills
the pool when the tier opens (docs/BENCHMARKS.md "Disk tier, engine level").

A buffer is given back once, by its last user: a write's by the writer, by `DiskStore.write` if
superseded first, or by the caller if refused; a read's by the reader on a failed check, else by
whoever staged it. A dropped buffer is simply garbage-collected.
"""

from __future__ import annotations

import threading


class BufferPool:
    def __init__(self, max_free_bytes: int) -> None:
        """Keep at most `max_free_bytes` of given-back buffers (the rest go to the garbage collector)."""
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[bytearray]] = {}
        self.free_bytes = 0  # bytes of the buffers kept in `_free`
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of `nbytes` (its contents are whatever its last user left)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.free_bytes -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray | memoryview) -> None:
        """Hand back an unused bytearray (or a view of all of one); anything else is left to the GC."""
        if isinstance(buf, memoryview):
            whole = buf.obj
            if not isinstance(whole, bytearray) or buf.nbytes != len(whole):
                return
            buf = whole
        if not isinstance(buf, bytearray):
            return
        with self._lock:
            if self.free_bytes + len(buf) <= self.max_free_bytes:
                self._free.setdefault(len(buf), []).append(buf)
                self.free_bytes += len(buf)

    def reserve(self, nbytes: int, count: int) -> int:
        """Add up to `count` fresh, page-touched buffers within `max_free_bytes`; returns how many."""
        made = 0
        while made < count:
            with self._lock:
                if self.free_bytes + nbytes > self.max_free_bytes:
                    break
                self.free_bytes += nbytes  # counted before the allocation: a concurrent give sees it
            buf = bytearray(nbytes)  # zero-filled: every page faulted in here
            with self._lock:
                self._free.setdefault(nbytes, []).append(buf)
            made += 1
        return made
