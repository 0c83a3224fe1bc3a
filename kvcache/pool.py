"""KV pools of one window group: the only owner of KV cache tensors in kvcache/.

Each level is one contiguous slot-major tensor, so a block moves with one row copy. Pools start
zeroed (attention masks unused positions, but 0 * NaN is NaN); the host pool is pinned under CUDA.

`execute` runs the copies in steps (`_steps`): gathers and scatters on the current stream,
host<->device DMAs on a stream per direction, in pieces with an event each (both copy engines run);
a scatter waits for its DMA, a DMA for its gather and the other direction's pieces of its host
slots. Host <-> disk copies (disk_pool.py) run on the CPU once no DMA uses their rows (`settle`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvcache.block import CopyOp, Level
from kvcache.disk_pool import DiskSlots
from kvcache.errors import KVCacheError
from kvcache.layout import CacheLayout

DMA_WAIT_S = 30.0  # the longest wait for a DMA before the CPU touches its host rows
DMA_CHUNK_SLOTS = 16  # slots per DMA piece: offloads wait only for the onboard pieces of their slots


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive ascending slots."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, slots[start], i - start))
            start = i
    return runs


Group = tuple[Level, Level, list[int], list[int]]  # (src level, dst level, src slots, dst slots ascending)
Write = Callable[[], None]  # the second half of a group's copy (its writes), when they must wait


def _chunks(runs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Runs in pieces of about DMA_CHUNK_SLOTS slots (a longer run is one piece)."""
    chunks: list[list[tuple[int, int, int]]] = []
    size = DMA_CHUNK_SLOTS
    for run in runs:
        if size >= DMA_CHUNK_SLOTS:
            chunks.append([])
            size = 0
        chunks[-1].append(run)
        size += run[2]
    return chunks


def _steps(ops: Sequence[CopyOp]) -> list[list[Group]]:
    """Ops in steps, each a parallel assignment with the result of running them one by one: an op goes
    after every step writing its source or destination, not before one reading its destination. One
    admission's chained offloads and onboards take one step (one by one: a 4k disk hit took 257)."""
    steps: list[dict[tuple[Level, Level], dict[int, int]]] = []
    written: dict[tuple[Level, int], int] = {}  # (level, slot) -> last step that writes it
    read: dict[tuple[Level, int], int] = {}  # (level, slot) -> last step that reads it
    for op in ops:
        src, dst = (op.src_level, op.src_slot), (op.dst_level, op.dst_slot)
        step = max(written.get(src, -1) + 1, written.get(dst, -1) + 1, read.get(dst, 0))
        if step == len(steps):
            steps.append({})
        steps[step].setdefault((op.src_level, op.dst_level), {})[op.dst_slot] = op.src_slot
        written[dst] = step
        read[src] = max(read.get(src, 0), step)
    return [[(s, d, [pairs[k] for k in sorted(pairs)], sorted(pairs)) for (s, d), pairs in step.items()]
            for step in steps]


def pool_rows(pool: torch.Tensor) -> torch.Tensor:
    """`pool` as `[num_slots, words]`: int64 words, or bytes when a slot is not a multiple of 8."""
    rows = pool.view(pool.shape[0], -1).view(torch.uint8)  # [num_slots, slot_bytes]
    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 else rows


class _TierStreams:
    """The two DMA streams of a CUDA pool pair, and the DMAs still in flight with their host slots."""

    def __init__(self, device: torch.device) -> None:
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.writes: list[tuple[torch.cuda.Event, frozenset[int]]] = []  # offloads writing host slots
        self.reads: list[tuple[torch.cuda.Event, frozenset[int]]] = []  # onboards reading host slots

    def settle(self, host_slots: list[int]) -> None:
        """Wait (at most DMA_WAIT_S) until no DMA in flight reads or writes these host slots."""
        deadline = time.monotonic() + DMA_WAIT_S
        for event, slots in self.writes + self.reads:
            while not slots.isdisjoint(host_slots) and not event.query():
                if time.monotonic() > deadline:
                    raise KVCacheError(f"a host<->device copy did not finish within {DMA_WAIT_S} s")
                time.sleep(50e-6)


def _prune(pending: list[tuple[torch.cuda.Event, frozenset[int]]]) -> None:
    pending[:] = [(event, slots) for event, slots in pending if not event.query()]


class GroupPools:
    def __init__(self, layout: CacheLayout, tokens_per_block: int, num_layers: int,
                 num_primary: int, num_secondary: int) -> None:
        slot_shape = layout.format.slot_shape(num_layers, tokens_per_block)
        # [num_slots, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]
        self.primary = torch.zeros((num_primary, *slot_shape), dtype=layout.format.dtype, device=layout.device)
        self.secondary: torch.Tensor | None = None
        if num_secondary:
            pin = layout.device.type == "cuda"
            self.secondary = torch.zeros((num_secondary, *slot_shape), dtype=layout.format.dtype, pin_memory=pin)
        self.slot_bytes = tokens_per_block * layout.bytes_per_token(num_layers)
        self._rows = (pool_rows(self.primary), None if self.secondary is None else pool_rows(self.secondary))
        self._streams = _TierStreams(layout.device) if num_secondary and layout.device.type == "cuda" else None
        self.disk: DiskSlots | None = None  # the disk level's files, when there is a disk tier

    def pool(self, level: Level) -> torch.Tensor | None:
        """The level's tensor (None: no slots, or the disk level, which is files)."""
        return {Level.PRIMARY: self.primary, Level.SECONDARY: self.secondary}.get(level)

    def execute(self, ops: Sequence[CopyOp]) -> None:
        """Run `ops` step by step (`_steps`): each group reads its sources, then the step's writes run
        (at once for a group whose destinations nobody in the step reads)."""
        try:
            for step in _steps(ops):
                reads = {(g[0], s) for g in step for s in g[2]}
                writes = [self._copy(*g, defer=any((g[1], d) in reads for d in g[3])) for g in step]
                for write in writes:
                    if write is not None:
                        write()
        finally:
            if self.disk is not None:
                self.disk.queue_writes()

    def _copy(self, src_level: Level, dst_level: Level, src: list[int], dst: list[int],
              defer: bool) -> Write | None:
        """dst rows (ascending) <- src rows: sources read now, the writes returned (None: done, only
        when not `defer`: nobody in the step reads a destination)."""
        if Level.DISK in (src_level, dst_level):
            return self._copy_disk(dst_level, src, dst)
        src_rows, dst_rows = self._rows[src_level], self._rows[dst_level]
        assert src_rows is not None and dst_rows is not None
        if src_rows.device == dst_rows.device:
            return _copy_same_device(src_rows, dst_rows, src, dst, defer)
        assert self._streams is not None  # pools on two devices: a CUDA primary and its host pool
        if dst_rows.device.type == "cpu":
            return _copy_to_host(src_rows, dst_rows, src, dst, self._streams)
        return _copy_to_device(src_rows, dst_rows, src, dst, self._streams)

    def _copy_disk(self, dst_level: Level, src: list[int], dst: list[int]) -> Write | None:
        """Host rows -> disk slots (copied out now, writes queued after the last step) or disk slots ->
        host rows (the staged bytes copied in as the write), on the CPU."""
        host = self._rows[Level.SECONDARY]
        disk, streams = self.disk, self._streams
        assert disk is not None and host is not None
        if dst_level is Level.DISK:
            if streams is not None:
                streams.settle(src)
            disk.copy_out(host, src, dst)
            return None

        def write() -> None:
            if streams is not None:
                streams.settle(dst)
            disk.copy_in(host, src, dst)
        return write


def _copy_same_device(src_rows: torch.Tensor, dst_rows: torch.Tensor, src: list[int], dst: list[int],
                      defer: bool) -> Write | None:
    """One pass when the destinations (or, across pools, the sources) are one contiguous run and
    nothing waits for the reads; else a gather now and a scatter as the write."""
    n = len(dst)
    if not defer and src_rows is not dst_rows and dst[-1] - dst[0] == n - 1:  # gather straight into the slots
        src_idx = torch.tensor(src, dtype=torch.int64, device=src_rows.device)
        torch.index_select(src_rows, 0, src_idx, out=dst_rows[dst[0]:dst[0] + n])
        return None
    first = min(src)
    if src_rows is not dst_rows and max(src) - first == n - 1 and len(set(src)) == n:  # scatter from slots
        dst_by_src = [0] * n
        for s, d in zip(src, dst, strict=True):
            dst_by_src[s - first] = d
        dst_idx = torch.tensor(dst_by_src, dtype=torch.int64, device=dst_rows.device)
        if not defer:
            dst_rows.index_copy_(0, dst_idx, src_rows[first:first + n])
            return None
        staged = src_rows[first:first + n].clone()
    else:
        staged = src_rows.index_select(0, torch.tensor(src, dtype=torch.int64, device=src_rows.device))
        dst_idx = torch.tensor(dst, dtype=torch.int64, device=dst_rows.device)
    return lambda: dst_rows.index_copy_(0, dst_idx, staged)  # gathers before scattering


def _dma(streams: _TierStreams, to_host: bool, runs: list[tuple[int, int, int]],
         copy: Callable[[int, int, int], object]) -> torch.cuda.Event:
    """`copy` each run (index, first host slot, length) on the direction's stream in pieces, each
    after the other direction's DMAs of its host slots, with an event; returns the last event."""
    stream, mine, other = (streams.d2h, streams.writes, streams.reads) if to_host else \
        (streams.h2d, streams.reads, streams.writes)
    done = None
    for chunk in _chunks(runs):
        slots = [first + k for _, first, n in chunk for k in range(n)]
        _prune(other)
        for event, used in other:
            if not used.isdisjoint(slots):
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            for i, first, n in chunk:
                copy(i, first, n)
        _prune(mine)
        done = torch.cuda.Event()
        done.record(stream)
        mine.append((done, frozenset(slots)))
    assert done is not None
    return done


def _copy_to_host(src_rows: torch.Tensor, dst_rows: torch.Tensor, src: list[int], dst: list[int],
                  streams: _TierStreams) -> Write:
    """Gather the device rows now; the write DMAs them into the host slots."""
    staged = src_rows.index_select(0, torch.tensor(src, dtype=torch.int64, device=src_rows.device))

    def write() -> None:
        streams.d2h.wait_stream(torch.cuda.current_stream(staged.device))  # after the gather
        _dma(streams, True, slot_runs(dst),
             lambda i, first, n: dst_rows[first:first + n].copy_(staged[i:i + n], non_blocking=True))
        staged.record_stream(streams.d2h)
    return write


def _copy_to_device(src_rows: torch.Tensor, dst_rows: torch.Tensor, src: list[int], dst: list[int],
                    streams: _TierStreams) -> Write:
    """DMA the host rows into a device buffer now; the write scatters it into the slots."""
    order = sorted(range(len(src)), key=src.__getitem__)
    src_sorted = [src[i] for i in order]
    staged = torch.empty((len(src), dst_rows.shape[1]), dtype=dst_rows.dtype, device=dst_rows.device)
    streams.h2d.wait_stream(torch.cuda.current_stream(staged.device))  # `staged` is allocated
    done = _dma(streams, False, slot_runs(src_sorted),
                lambda i, first, n: staged[i:i + n].copy_(src_rows[first:first + n], non_blocking=True))
    dst_idx = torch.tensor([dst[i] for i in order], dtype=torch.int64, device=dst_rows.device)

    def write() -> None:
        torch.cuda.current_stream(staged.device).wait_event(done)
        dst_rows.index_copy_(0, dst_idx, staged)
    return write
