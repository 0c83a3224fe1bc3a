"""KV pools of one window group: the only owner of KV cache tensors in kvcache/.

Each level is one contiguous tensor, slot-major: [num_slots, num_layers, 2 (K, V), tokens_per_block,
num_kv_heads, head_dim]. A slot is `slot_bytes` contiguous bytes, so a block moves with one row copy
and its address is `base + slot * slot_bytes`. Both pools start zeroed: attention masks unused or
out-of-window positions, but 0 * NaN would still be NaN. The secondary pool lives in host memory,
pinned when the primary pool is on CUDA.

Copies: `execute` runs the block manager's copy ops in order, one batched indexed copy per run of
consecutive ops with the same (src level, dst level). On CUDA the device-side gathers and scatters
run on the current stream; the host<->device DMAs (from/to pinned memory) run on two side streams,
one per direction (`_TierStreams`), so an admission that offloads evicted blocks while it onboards
others moves both at once on the GPU's two copy engines. Order is kept where it matters: a scatter
waits for its onboard DMA; a DMA waits for the gather that staged it; a DMA that touches a host slot
another direction's DMA may still be using waits for that one first.

Copies between the host pool and the disk tier (kvcache/disk_pool.py) run on the CPU: before it
reads or writes host rows, every DMA still using them has finished (`_TierStreams.settle`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvcache.block import CopyOp, Level
from kvcache.disk_pool import DiskSlots
from kvcache.errors import KVCacheError
from kvcache.layout import CacheLayout

DMA_WAIT_S = 30.0  # the longest wait for a DMA before the CPU touches its host rows


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive ascending slots."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, slots[start], i - start))
            start = i
    return runs


def _batches(ops: Sequence[CopyOp]) -> list[tuple[tuple[Level, Level], list[CopyOp]]]:
    """Ops grouped into ordered batches of one (src level, dst level) each, with the result of running
    them one by one: a batch gathers all its sources, then writes. An op goes after the last batch it
    conflicts with (reads a slot written there, or writes a slot read or written there) — into that
    batch itself when it only writes a slot the batch reads or writes (the batch keeps the last
    write) — else into the first later batch of its kind. So the offloads and onboards that one
    admission interleaves (offload a victim, onboard into its slot, ...) become one batch each: one
    gather, one scatter, few DMAs."""
    batches: list[tuple[tuple[Level, Level], list[CopyOp], set, set]] = []
    for op in ops:
        key, src, dst = (op.src_level, op.dst_level), (op.src_level, op.src_slot), (op.dst_level, op.dst_slot)
        home, start = None, 0
        for i in range(len(batches) - 1, -1, -1):
            k, _, reads, writes = batches[i]
            if src in writes:
                start = i + 1
                break
            if dst in reads or dst in writes:
                home, start = (batches[i] if k == key else None), i + 1
                break
        if home is None:
            home = next((b for b in batches[start:] if b[0] == key), None)
        if home is None:
            home = (key, [], set(), set())
            batches.append(home)
        home[1].append(op)
        home[2].add(src)
        home[3].add(dst)
    return [(key, batch) for key, batch, _, _ in batches]


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [num_slots, slot_bytes / itemsize] rows of int64 (uint8 if not divisible by 8)."""
    flat = pool.view(pool.shape[0], -1)
    try:
        return flat.view(torch.int64)
    except RuntimeError:
        return flat.view(torch.uint8)


class _TierStreams:
    """The two DMA streams of a CUDA pool pair, and the DMAs still in flight with their host slots."""

    def __init__(self, device: torch.device) -> None:
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.writes: list[tuple[torch.cuda.Event, frozenset[int]]] = []  # offloads writing host slots
        self.reads: list[tuple[torch.cuda.Event, frozenset[int]]] = []  # onboards reading host slots

    def before_offload(self, host_slots: list[int]) -> None:
        """The d2h stream waits for onboards still reading any of these host slots."""
        _wait_for_overlap(self.d2h, self.reads, host_slots)

    def before_onboard(self, host_slots: list[int]) -> None:
        _wait_for_overlap(self.h2d, self.writes, host_slots)

    def after_offload(self, host_slots: list[int]) -> None:
        _prune(self.writes)
        self.writes.append((_recorded(self.d2h), frozenset(host_slots)))

    def after_onboard(self, host_slots: list[int]) -> torch.cuda.Event:
        _prune(self.reads)
        event = _recorded(self.h2d)
        self.reads.append((event, frozenset(host_slots)))
        return event

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


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait_for_overlap(stream: torch.cuda.Stream, pending: list[tuple[torch.cuda.Event, frozenset[int]]],
                      host_slots: list[int]) -> None:
    """Drop finished DMAs from `pending`; make `stream` wait for those that touch `host_slots`."""
    _prune(pending)
    for event, slots in pending:
        if not slots.isdisjoint(host_slots):
            stream.wait_event(event)


class GroupPools:
    def __init__(self, layout: CacheLayout, tokens_per_block: int, num_layers: int,
                 num_primary: int, num_secondary: int) -> None:
        slot_shape = (num_layers, 2, tokens_per_block, layout.num_kv_heads, layout.head_dim)
        self.device = layout.device
        # [num_slots, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]
        self.primary = torch.zeros((num_primary, *slot_shape), dtype=layout.dtype, device=layout.device)
        self.secondary: torch.Tensor | None = None
        if num_secondary:
            pin = layout.device.type == "cuda"
            self.secondary = torch.zeros((num_secondary, *slot_shape), dtype=layout.dtype, pin_memory=pin)
        self.slot_bytes = tokens_per_block * layout.bytes_per_token(num_layers)
        self._rows = (_rows(self.primary), None if self.secondary is None else _rows(self.secondary))
        self._streams = _TierStreams(layout.device) if num_secondary and layout.device.type == "cuda" else None
        self.disk: DiskSlots | None = None  # the disk level's files, when there is a disk tier

    def pool(self, level: Level) -> torch.Tensor | None:
        """The level's tensor (None: no slots, or the disk level, which is files)."""
        return {Level.PRIMARY: self.primary, Level.SECONDARY: self.secondary}.get(level)

    def execute(self, ops: Sequence[CopyOp]) -> None:
        """Run `ops` with the result of running them one by one, in a few batches (`_batches`)."""
        for (src_level, dst_level), batch in _batches(ops):
            # a destination written twice keeps the later source: the dict keeps the last write
            pairs = sorted({op.dst_slot: op.src_slot for op in batch}.items())
            self._copy(src_level, dst_level, [s for _, s in pairs], [d for d, _ in pairs])

    def _copy(self, src_level: Level, dst_level: Level, src: list[int], dst: list[int]) -> None:
        """dst rows (ascending) <- src rows, in one indexed copy (plus one DMA per contiguous run)."""
        if Level.DISK in (src_level, dst_level):
            self._copy_disk(dst_level, src, dst)
            return
        src_rows, dst_rows = self._rows[src_level], self._rows[dst_level]
        assert src_rows is not None and dst_rows is not None
        if src_rows.device == dst_rows.device:
            self._copy_same_device(src_rows, dst_rows, src, dst)
        elif dst_rows.device.type == "cpu":
            self._copy_to_host(src_rows, dst_rows, src, dst, self._streams)
        else:
            self._copy_to_device(src_rows, dst_rows, src, dst, self._streams)

    def _copy_disk(self, dst_level: Level, src: list[int], dst: list[int]) -> None:
        """Host rows -> disk slots (dst_level DISK) or disk slots -> host rows, on the CPU."""
        host = self._rows[Level.SECONDARY]
        assert self.disk is not None and host is not None
        if self._streams is not None:
            self._streams.settle(src if dst_level is Level.DISK else dst)
        if dst_level is Level.DISK:
            self.disk.write(host, src, dst)
        else:
            self.disk.read(host, src, dst)

    @staticmethod
    def _copy_same_device(src_rows: torch.Tensor, dst_rows: torch.Tensor, src: list[int],
                          dst: list[int]) -> None:
        """One pass when the destinations (or, across pools, the sources) are one contiguous run."""
        n = len(dst)
        if src_rows is not dst_rows and dst[-1] - dst[0] == n - 1:  # gather straight into the slots
            src_idx = torch.tensor(src, dtype=torch.int64, device=src_rows.device)
            torch.index_select(src_rows, 0, src_idx, out=dst_rows[dst[0]:dst[0] + n])
            return
        first = min(src)
        if src_rows is not dst_rows and max(src) - first == n - 1 and len(set(src)) == n:  # scatter from slots
            dst_by_src = [0] * n
            for s, d in zip(src, dst, strict=True):
                dst_by_src[s - first] = d
            dst_idx = torch.tensor(dst_by_src, dtype=torch.int64, device=dst_rows.device)
            dst_rows.index_copy_(0, dst_idx, src_rows[first:first + n])
            return
        src_idx = torch.tensor(src, dtype=torch.int64, device=src_rows.device)
        dst_idx = torch.tensor(dst, dtype=torch.int64, device=dst_rows.device)
        dst_rows.index_copy_(0, dst_idx, src_rows.index_select(0, src_idx))  # gathers before scattering

    @staticmethod
    def _copy_to_host(src_rows: torch.Tensor, dst_rows: torch.Tensor, src: list[int],
                      dst: list[int], streams: _TierStreams | None) -> None:
        staged = src_rows.index_select(0, torch.tensor(src, dtype=torch.int64, device=src_rows.device))
        if streams is None:  # no CUDA: plain copies
            for i, first, n in _runs(dst):
                dst_rows[first:first + n].copy_(staged[i:i + n])
            return
        streams.before_offload(dst)
        streams.d2h.wait_stream(torch.cuda.current_stream(staged.device))  # after the gather
        with torch.cuda.stream(streams.d2h):
            for i, first, n in _runs(dst):
                dst_rows[first:first + n].copy_(staged[i:i + n], non_blocking=True)
        staged.record_stream(streams.d2h)
        streams.after_offload(dst)

    @staticmethod
    def _copy_to_device(src_rows: torch.Tensor, dst_rows: torch.Tensor, src: list[int],
                        dst: list[int], streams: _TierStreams | None) -> None:
        order = sorted(range(len(src)), key=src.__getitem__)
        src_sorted = [src[i] for i in order]
        staged = torch.empty((len(src), dst_rows.shape[1]), dtype=dst_rows.dtype, device=dst_rows.device)
        if streams is None:
            for i, first, n in _runs(src_sorted):
                staged[i:i + n].copy_(src_rows[first:first + n])
        else:
            streams.before_onboard(src_sorted)
            streams.h2d.wait_stream(torch.cuda.current_stream(staged.device))  # `staged` is allocated
            with torch.cuda.stream(streams.h2d):
                for i, first, n in _runs(src_sorted):
                    staged[i:i + n].copy_(src_rows[first:first + n], non_blocking=True)
            torch.cuda.current_stream(staged.device).wait_event(streams.after_onboard(src_sorted))
        dst_idx = torch.tensor([dst[i] for i in order], dtype=torch.int64, device=dst_rows.device)
        dst_rows.index_copy_(0, dst_idx, staged)
