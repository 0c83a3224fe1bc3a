"""The disk tier's directory, files and threads (no torch; bytes in, bytes out).

One file per (window group, slot) (disk_format.py), written under a temporary name and renamed: a
reader never sees half of one, a crash loses at most the blocks being written, a read is sequential.

The engine thread calls every public method and never blocks on a write: `write` queues the bytes
(up to `write_queue_bytes`) for writer threads sharded by slot (one slot's writes stay in order); a
newer write supersedes a queued one, whose slot is read from a copy of the queued bytes until it
lands. `read_many` checks a batch of files on reader threads within `io_timeout_s` (hashlib releases
the GIL, so checks run in parallel). Payloads move once each way, hashed in pieces while in cache,
through reused buffers (disk_buffers.py). `open` takes the directory (disk_dir.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvcache.config import DiskTierConfig
from kvcache.disk_buffers import BufferPool
from kvcache.disk_dir import StartUp, read_header, restore_or_reset, take_directory
from kvcache.disk_format import (
    CHUNK_BYTES,
    MAC_BYTES,
    BadFile,
    BlockFormat,
    BlockHeader,
    Manifest,
    check_digest,
    encode_prefix,
    payload_hasher,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockMeta:
    """What a block file says about its block, besides its bytes (see disk_format.BlockHeader)."""

    block_hash: bytes
    parent_hash: bytes | None
    root_salt: bytes
    tokens: tuple[int, ...]
    priority: int


# a reader's piece: on the H200 box's 16 cores a 512 MiB warm hit read and checked in 54 ms with
# 1 MiB pieces, 66-111 ms with 256 KiB (fewer GIL round trips per block; still within a core's L2)
READ_CHUNK_BYTES = 1 << 20


@dataclass
class _Write:
    gen: int
    meta: BlockMeta
    payload: bytearray | memoryview
    nbytes: int
    taken: bool = False  # a writer thread has it (and gives its buffer back)


@dataclass
class DiskIOStats:
    bytes_written: int = 0
    write_errors: int = 0
    queued_bytes: int = 0  # waiting for their write now
    restored: int = 0  # blocks found again at start (set by the tier)
    skipped_at_start: dict[str, int] = field(default_factory=dict)  # files not restored, by reason


class DiskStore:
    def __init__(self, path: Path, key: bytes, config: DiskTierConfig, slot_bytes: dict[int, int],
                 formats: dict[int, BlockFormat] | None = None) -> None:
        """Use `open`: it takes the lock and checks the manifest first."""
        self.path, self.key, self.config = path, key, config
        self.slot_bytes = slot_bytes  # window -> payload bytes of one block
        # window -> its blocks' format, in every file's header (a file saying otherwise is never served)
        self.formats = formats or {}
        self.stats = DiskIOStats()
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], _Write] = {}
        self._gens = itertools.count(1)
        self._stop = threading.Event()
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(config.write_threads)]
        self._writers = [threading.Thread(target=self._write_loop, args=(q,), name=f"kv-disk-write-{i}",
                                          daemon=True) for i, q in enumerate(self._queues)]
        self._readers = concurrent.futures.ThreadPoolExecutor(config.read_threads, "kv-disk-read")
        # the write queue's buffers and a hit's read buffers, kept for reuse
        self.buffers = BufferPool(2 * config.write_queue_bytes)
        self._lock_fd = -1

    @classmethod
    def open(cls, config: DiskTierConfig, key: bytes, manifest: Manifest, slots: dict[int, tuple[int, int]],
             formats: dict[int, BlockFormat] | None = None) -> tuple[DiskStore, dict[int, list[BlockHeader]]]:
        """The store on `config.path` and the checked headers found there per window (`slots`: window ->
        (disk slots, payload bytes of a block)); ValueError naming the key when it cannot be used."""
        path = Path(config.path).expanduser()
        store = cls(path, key, config, {w: nbytes for w, (_, nbytes) in slots.items()}, formats)
        store._lock_fd = take_directory(path)
        start = StartUp(path, key, {w: n for w, (n, _) in slots.items()}, store.slot_bytes, store.format_of)
        try:
            found = restore_or_reset(start, manifest)
        except OSError as exc:
            store.close()
            raise ValueError(f"kv_cache_config.disk.path={str(path)!r}: cannot use the directory: "
                             f"{exc.strerror or exc}") from None
        store.stats.skipped_at_start = start.skipped
        for writer in store._writers:
            writer.start()
        return store, found

    # ---- engine thread API
    def write(self, window: int, slot: int, meta: BlockMeta, payload: bytearray | memoryview) -> bool:
        """Queue a block's bytes (handed over unchanged until written; a `buffers` bytearray goes back
        there, a refused one stays the caller's); False when the queue is full."""
        n = memoryview(payload).nbytes
        with self._lock:
            old = self._pending.get((window, slot))
            queued = self.stats.queued_bytes - (old.nbytes if old else 0)
            if queued + n > self.config.write_queue_bytes:
                return False
            gen = next(self._gens)
            self._pending[window, slot] = _Write(gen, meta, payload, n)
            if old is not None and not old.taken:  # superseded before a writer got it
                self.buffers.give(old.payload)
            self.stats.queued_bytes = queued + n
        self._queues[slot % len(self._queues)].put((window, slot, gen))
        return True

    def read_many(self, items: list[tuple[int, int, bytes]]) -> list[memoryview | BadFile]:
        """The checked payload of each (window, slot, expected block hash), or why not (BadFile): from
        the write queue until the slot's write lands, else read within io_timeout_s."""
        out: list[memoryview | BadFile | None] = [None] * len(items)
        with self._lock:
            for i, (window, slot, block_hash) in enumerate(items):
                job = self._pending.get((window, slot))
                if job is not None:
                    out[i] = self._copy(job.payload) if job.meta.block_hash == block_hash else BadFile(
                        "stale", f"slot {slot} of window {window} is being written with another block")
        futures = {i: self._readers.submit(self._read_file, *item) for i, item in enumerate(items) if out[i] is None}
        done, _ = concurrent.futures.wait(futures.values(), timeout=self.config.io_timeout_s)
        for i, future in futures.items():
            if future not in done:
                out[i] = BadFile("timeout", f"not read within io_timeout_s={self.config.io_timeout_s}")
                continue
            try:
                out[i] = future.result()
            except BadFile as exc:
                out[i] = exc
            except OSError as exc:
                out[i] = BadFile("io_error", str(exc))
        return out  # type: ignore[return-value]

    def delete(self, window: int, slot: int) -> None:
        """Remove a slot's file (it failed its check); its slot is free, and no write of it is queued."""
        try:
            self._file(window, slot).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("disk tier: could not delete %s: %s", self._file(window, slot), exc)

    def close(self) -> None:
        """Let queued writes land (at most io_timeout_s), stop the threads, release the directory."""
        deadline = time.monotonic() + self.config.io_timeout_s
        while self._pending and time.monotonic() < deadline and any(w.is_alive() for w in self._writers):
            time.sleep(0.01)
        if self._pending:
            log.warning("disk tier: %d block writes still queued at close are lost", len(self._pending))
        self._stop.set()
        for jobs in self._queues:  # wake each writer now instead of at its next get timeout
            jobs.put(None)
        for writer in self._writers:
            if writer.is_alive():
                writer.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        self._readers.shutdown(wait=False, cancel_futures=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def format_of(self, window: int) -> BlockFormat:
        return self.formats.get(window) or BlockFormat()

    # ---- files
    def _file(self, window: int, slot: int) -> Path:
        return self.path / f"w{window}" / f"{slot}.kv"

    def _write_loop(self, jobs: queue.SimpleQueue) -> None:
        while not (self._stop.is_set() and jobs.empty()):
            try:
                item = jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:  # close(): stop set, look again
                continue
            window, slot, gen = item
            with self._lock:
                job = self._pending.get((window, slot))
                if job is None or job.gen != gen:
                    continue  # superseded by a newer write of the slot
                job.taken = True
            ok = self._write_file(window, slot, job)
            self.buffers.give(job.payload)
            with self._lock:
                if self._pending.get((window, slot)) is job:
                    del self._pending[window, slot]
                    self.stats.queued_bytes -= job.nbytes
                if ok:
                    self.stats.bytes_written += job.nbytes
                else:
                    self.stats.write_errors += 1

    def _write_file(self, window: int, slot: int, job: _Write) -> bool:
        meta, target, fmt = job.meta, self._file(window, slot), self.format_of(window)
        header = BlockHeader(window, slot, meta.block_hash, meta.parent_hash, meta.root_salt, meta.tokens,
                             meta.priority, time.time_ns(), job.nbytes, bytes(MAC_BYTES), fmt.dtype, fmt.scales)
        tmp = target.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                self._write_block(fd, header, memoryview(job.payload))
            finally:
                os.close(fd)
            os.replace(tmp, target)
            return True
        except OSError as exc:
            log.warning("disk tier: writing %s failed: %s", target, exc)
            for name in (tmp, target):  # no stale file under the slot's name
                with contextlib.suppress(OSError):
                    os.unlink(name)
            return False

    def _write_block(self, fd: int, header: BlockHeader, payload: memoryview) -> None:
        """The payload after room for the prefix, hashed piece by piece; then the prefix with its MAC."""
        start = len(encode_prefix(self.key, header))  # the MAC's length is fixed: so is the prefix's
        h = payload_hasher(self.key)
        for at in range(0, payload.nbytes, CHUNK_BYTES):
            piece = payload[at:at + CHUNK_BYTES]
            h.update(piece)
            _pwrite_all(fd, piece, start + at)
        prefix = encode_prefix(self.key, msgspec.structs.replace(header, payload_mac=h.digest()))
        assert len(prefix) == start
        _pwrite_all(fd, memoryview(prefix), 0)

    def _read_file(self, window: int, slot: int, block_hash: bytes) -> memoryview:
        try:
            fd = os.open(self._file(window, slot), os.O_RDONLY)
        except FileNotFoundError:
            raise BadFile("missing", f"no file for slot {slot} of window {window}") from None
        try:
            header, offset = read_header(fd, self.key, window, slot, self.slot_bytes[window], self.format_of(window),
                                         block_hash)
            buf = self.buffers.take(header.payload_bytes)
            try:
                check_digest(header, self._read_payload(fd, offset, memoryview(buf)))
            except BaseException:
                self.buffers.give(buf)
                raise
            return memoryview(buf)
        finally:
            os.close(fd)

    def _read_payload(self, fd: int, offset: int, view: memoryview) -> bytes:
        """Fill `view` from the file at `offset`, piece by piece; the payload MAC of what was read."""
        h = payload_hasher(self.key)
        for at in range(0, view.nbytes, READ_CHUNK_BYTES):
            piece = view[at:at + READ_CHUNK_BYTES]
            got = 0
            while got < piece.nbytes:
                n = os.preadv(fd, [piece[got:]], offset + at + got)
                if not n:
                    raise BadFile("truncated", f"the file ended {view.nbytes - at - got} bytes early")
                got += n
            h.update(piece)
        return h.digest()

    def _copy(self, payload: bytearray | memoryview) -> memoryview:
        """A buffer of its own with a queued write's bytes (the writer gives the queued one back)."""
        buf = self.buffers.take(memoryview(payload).nbytes)
        view = memoryview(buf)
        view[:] = payload
        return view


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)
