"""Where a disk hit's time goes on the engine thread, for scripts/bench_gpu_disk.py: spans of the
disk tier's steps (wrapped for the benchmark only), and the raw read bandwidth of its directory.

- check_ms: `DiskStore.read_many` (files read and checked on the reader threads; the engine waits);
- disk_to_host_ms / host_to_disk_ms: `DiskSlots.copy_in` / `copy_out` (staged bytes -> host rows,
  host rows -> write buffers: CPU copies on the engine thread);
- tier_copies_ms: every `GroupPools.execute` (the two above plus host <-> device);
  copy_batches: its groups (`GroupPools._copy`: one per level pair and step, kvcache/pool.py `_steps`);
- fresh_buffers: buffers the pool had to allocate (page faults) instead of reusing.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from kvcache.disk_buffers import BufferPool
from kvcache.disk_pool import DiskSlots
from kvcache.disk_store import DiskStore
from kvcache.pool import GroupPools

SPANS: Counter[str] = Counter()
_WRAPPED = {"check_ms": (DiskStore, "read_many"), "disk_to_host_ms": (DiskSlots, "copy_in"),
            "host_to_disk_ms": (DiskSlots, "copy_out"), "tier_copies_ms": (GroupPools, "execute"),
            "copy_batches_ms": (GroupPools, "_copy")}


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS[name] += (time.perf_counter() - start) * 1000
            SPANS[name.removesuffix("_ms") + "_calls"] += 1
    return wrapper


def _counting_take(fn):
    def take(self: BufferPool, nbytes: int) -> bytearray:
        if not self._free.get(nbytes):
            SPANS["fresh_buffers"] += 1
        return fn(self, nbytes)
    return take


def install() -> None:
    for name, (cls, attr) in _WRAPPED.items():
        setattr(cls, attr, _timed(name, getattr(cls, attr)))
    BufferPool.take = _counting_take(BufferPool.take)


def spans_of(fn) -> tuple[object, dict[str, float]]:
    """fn()'s result and the spans it added (rounded)."""
    SPANS.clear()
    out = fn()
    spans = {k: round(v, 1) for k, v in SPANS.items()}
    spans["copy_batches"] = spans.pop("copy_batches_calls", 0)
    spans.pop("copy_batches_ms", None)
    return out, spans


def raw_read_gb_s(files: list[Path], drop: Callable[[list[Path]], None], threads: int = 16) -> float:
    """Cold read bandwidth of `files` (`drop` takes them out of the page cache first): plain preadv
    into one reused buffer per thread, `threads` files at once, nothing checked."""
    size = max(f.stat().st_size for f in files)

    def read(path: Path, buf: memoryview) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            got = 0
            while n := os.preadv(fd, [buf[got:]], got):
                got += n
            return got
        finally:
            os.close(fd)

    local = threading.local()

    def one(path: Path) -> int:
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(size))
        return read(path, local.buf)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:  # buffers faulted in before the clock
        list(pool.map(lambda _: one(files[0]), range(threads)))
    drop(files)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, files))
    return total / (time.perf_counter() - start) / 1e9
