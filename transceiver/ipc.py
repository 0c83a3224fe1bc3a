"""Same-GPU fast path of the KV link: CUDA IPC handles of the primary pools, device-side copies.

The sender exports its pools per receiver handshake (`export_pools`, on the engine thread:
`_share_cuda_` rewraps the storage's data pointer, which must not race other users); the receiver
opens them once per (endpoint, epoch) (`open_pools`) and copies slots per pull (`start_copy`). Both
sides compute `payload.checksum` on the device (`DeviceSum`) without waiting: Triton kernels on CUDA
(`kernels.py`, imported only here), else torch. Importing this module needs no CUDA.

One export per receiver: torch's ref counter per export then makes a sender's exit warn ("Producer
process has been terminated before all shared CUDA tensors released") only for live mappings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from transceiver.payload import pool_rows
from transceiver.wire import CudaIpcPool, IpcOffer, PeerIdentity, node_name

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
BATCH_BYTES = 64 << 20  # bound on the temporary gather buffer of a checksum or copy (torch path)
MASK64 = (1 << 64) - 1
KERNELS_ENV = "PDSERVE_IPC_KERNELS"  # "torch": the gather/scatter path on CUDA too (A/B runs)

log = logging.getLogger(__name__)


def export_pools(pools: dict[int, torch.Tensor], identity: PeerIdentity) -> IpcOffer | None:
    """The IPC handle of every window's primary pool, or None (logged: that receiver gets bytes)."""
    exported = []
    try:
        for window, pool in sorted(pools.items()):
            if not pool.is_cuda or not pool.is_contiguous() or pool.storage_offset() != 0:
                raise ValueError(f"window {window}: the primary pool is not a whole contiguous CUDA storage")
            fields = pool.untyped_storage()._share_cuda_()
            exported.append(CudaIpcPool(window, int(pool.shape[0]), *fields))
    except (RuntimeError, ValueError) as e:  # CUDA refused
        log.warning("KV sender: CUDA IPC export of the KV pools failed, serving bytes: %s", e)
        return None
    return IpcOffer(identity=identity, pools=exported)


def open_pools(offer: IpcOffer, own: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Views of the sender's pools, shaped like ours with its slot count, on our device (raises when
    a handle cannot be opened or does not fit)."""
    if sorted(p.window for p in offer.pools) != sorted(own):
        raise ValueError(f"the offer's windows {[p.window for p in offer.pools]} are not ours {sorted(own)}")
    views = {}
    for p in offer.pools:
        pool = own[p.window]
        slot_bytes = pool[0].numel() * pool.element_size()
        if p.num_slots < 1 or p.num_slots * slot_bytes > p.storage_size_bytes:
            raise ValueError(f"window {p.window}: {p.num_slots} slots of {slot_bytes} B do not fit the "
                             f"exported {p.storage_size_bytes} B")
        storage = torch.UntypedStorage._new_shared_cuda(
            pool.device.index, p.handle, p.storage_size_bytes, p.storage_offset_bytes,
            p.ref_counter_handle, p.ref_counter_offset, p.event_handle, p.event_sync_required)
        view = torch.empty(0, dtype=pool.dtype, device=pool.device)
        views[p.window] = view.set_(storage, 0, (p.num_slots, *pool.shape[1:]))
    return views


class DeviceSum:
    """A checksum queued on the current stream (CPU: done already). Keeps the tensors it uses alive
    until read, so a peer's pool is not unmapped under a running copy."""

    def __init__(self, total: torch.Tensor, keep: tuple[torch.Tensor, ...]) -> None:
        self._event: torch.cuda.Event | None = None
        self._device = total.device
        self._host = total  # int64 scalar
        if total.is_cuda:
            self._host = torch.empty((), dtype=torch.int64, pin_memory=True)
            self._host.copy_(total, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(total.device))
        self._keep: tuple[torch.Tensor, ...] = (total, *keep)

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def value(self) -> int:
        """The checksum (`payload.checksum`'s value); only once `done()`."""
        assert self.done(), "the device has not finished this checksum"
        self._keep = ()
        return int(self._host.item()) & MASK64

    def synchronize(self) -> None:
        """Block until done (CUDA: releases the GIL while it waits)."""
        if self._event is not None:
            self._event.synchronize()

    def order_before_current(self) -> None:
        """Work queued on its device's current stream from now on runs after this (no host wait)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)


def _fused(*tensors: torch.Tensor):
    """transceiver/kernels.py for CUDA tensors; None: the torch path (no triton, or KERNELS_ENV=torch)."""
    if not all(t.is_cuda for t in tensors) or os.environ.get(KERNELS_ENV, "triton") == "torch":
        return None
    try:
        from transceiver import kernels
    except ImportError:
        return None
    return kernels


def _index_batches(slots: list[int], slot_bytes: int, device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """(position in `slots`, slot indices on `device`) in batches of at most BATCH_BYTES."""
    per_batch = max(1, BATCH_BYTES // slot_bytes)
    index = torch.tensor(slots, dtype=torch.long, device=device)
    for start in range(0, len(slots), per_batch):
        yield start, index[start : start + per_batch]


def _device_index(slots: list[int], device: torch.device) -> torch.Tensor:
    """`slots` as int64 on `device`; to CUDA from pinned memory without waiting (a copy from pageable
    memory would first wait for everything queued on the stream)."""
    index = torch.tensor(slots, dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _weighted(sums: torch.Tensor, first: int) -> torch.Tensor:
    """sum_b (2 * (first + b) + 1) * sums[b], wrapping int64 (`payload.checksum`'s weights)."""
    weights = 2 * (torch.arange(sums.shape[0], dtype=torch.int64, device=sums.device) + first) + 1
    return (sums * weights).sum()


def start_checksum(pool: torch.Tensor, slots: list[int], first: int) -> DeviceSum:
    """`payload.checksum` of blocks first, first+1, ... in `slots` of `pool`, queued on the current
    stream (CUDA: one pass, `kernels.slot_sums`)."""
    rows = pool_rows(pool)  # [num_slots, words]
    kernels = _fused(pool)
    if kernels is not None:
        index = _device_index(slots, pool.device)
        sums = kernels.slot_sums(rows, index)
        return DeviceSum(_weighted(sums, first), (pool, index, sums))
    slot_bytes = rows.shape[1] * rows.element_size()
    total = torch.zeros((), dtype=torch.int64, device=pool.device)
    for start, index in _index_batches(slots, slot_bytes, pool.device):
        total += _weighted(rows.index_select(0, index).sum(dim=1, dtype=torch.int64), first + start)  # S_b, wrapping
    return DeviceSum(total, (pool,))


def start_copy(src: torch.Tensor, src_slots: list[int], dst: torch.Tensor, dst_slots: list[int],
               first: int) -> DeviceSum:
    """dst[dst_slots[i]] = src[src_slots[i]] on the current stream, and `start_checksum`'s value of the
    rows as read (CUDA: one pass, `kernels.copy_slot_sums`; else bounded batches)."""
    src_rows, dst_rows = pool_rows(src), pool_rows(dst)  # [slots, words]
    dst_index = _device_index(dst_slots, dst.device)
    kernels = _fused(src, dst)
    if kernels is not None:
        src_index = _device_index(src_slots, src.device)
        sums = kernels.copy_slot_sums(src_rows, src_index, dst_rows, dst_index)
        return DeviceSum(_weighted(sums, first), (src, dst, src_index, dst_index, sums))
    slot_bytes = dst_rows.shape[1] * dst_rows.element_size()
    total = torch.zeros((), dtype=torch.int64, device=dst.device)
    for start, index in _index_batches(src_slots, slot_bytes, src.device):
        rows = src_rows.index_select(0, index)
        dst_rows.index_copy_(0, dst_index[start : start + index.numel()], rows)
        total += _weighted(rows.sum(dim=1, dtype=torch.int64), first + start)
    return DeviceSum(total, (src, dst))


def ipc_identity(pools: dict[int, torch.Tensor], enabled: bool) -> PeerIdentity | None:
    """What a side says about itself in the handshake (None: bytes only, unless `enabled` with CUDA
    pools): machine, boot ("unknown" if unreadable: the GPU's UUID names one machine) and GPU."""
    if not enabled or not pools or not all(p.is_cuda for p in pools.values()):
        return None
    try:
        boot_id = BOOT_ID.read_text().strip()
    except OSError:
        boot_id = "unknown"
    uuid = str(torch.cuda.get_device_properties(next(iter(pools.values())).device).uuid)
    return PeerIdentity(hostname=node_name(), boot_id=boot_id, gpu_uuid=uuid, pid=os.getpid())
