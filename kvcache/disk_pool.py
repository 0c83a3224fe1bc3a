"""One window group's disk level as its pools see it: host rows <-> the disk store's files.

Host -> disk (`copy_out`): rows copied into store buffers now (the host slots are free at once),
queued once the call's copies are done (`queue_writes`; refused ones listed for the tier to drop).
Disk -> host (`copy_in`): bytes read and checked before the promotion (`stage`, disk_tier.py).
`GroupPools` calls both after any DMA using those host rows; a call's rows move in one `copy_rows`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcache.disk_store import BlockMeta, DiskStore
from kvcache.errors import KVCacheError


class DiskSlots:
    def __init__(self, store: DiskStore, window: int, describe: Callable[[int], BlockMeta | None]) -> None:
        self.store = store
        self.window = window
        self.describe = describe  # disk slot -> the block there now (None: free)
        self.staged: dict[int, memoryview] = {}  # disk slot -> checked payload, for this call
        self.refused: list[int] = []  # disk slots whose write the queue refused (the tier drops them)
        self.outgoing: list[tuple[int, BlockMeta, bytearray]] = []  # copied out, to queue (`queue_writes`)

    def stage(self, slot: int, payload: memoryview) -> None:
        """Keep a checked payload (a buffer of the store's, now this object's) for the copy of `slot`."""
        old = self.staged.pop(slot, None)
        if old is not None and old is not payload:
            self.store.buffers.give(old)
        self.staged[slot] = payload

    def forget(self) -> None:
        for payload in self.staged.values():
            self.store.buffers.give(payload)
        self.staged.clear()

    def copy_out(self, host_rows: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Copy host rows `src` ([num_host_slots, words]) into write buffers for disk slots `dst` now."""
        host_bytes = host_rows.view(torch.uint8)  # [num_host_slots, slot_bytes]
        jobs = [(host_slot, slot, meta) for host_slot, slot in zip(src, dst, strict=True)
                if (meta := self.describe(slot)) is not None]  # None: dropped again within the call
        bufs = [self.store.buffers.take(host_bytes.shape[1]) for _ in jobs]
        copy_rows([torch.frombuffer(buf, dtype=torch.uint8) for buf in bufs], [host_bytes[h] for h, _, _ in jobs])
        self.outgoing += [(slot, meta, buf) for (_, slot, meta), buf in zip(jobs, bufs, strict=True)]

    def queue_writes(self) -> None:
        """Queue what `copy_out` copied after the call's copies (hashing would compete for the GIL)."""
        for slot, meta, buf in self.outgoing:
            if not self.store.write(self.window, slot, meta, buf):
                self.store.buffers.give(buf)
                self.refused.append(slot)
        self.outgoing.clear()

    def copy_in(self, host_rows: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Copy the staged bytes of disk slots `src` into host rows `dst`."""
        host_bytes = host_rows.view(torch.uint8)  # [num_host_slots, slot_bytes]
        payloads = []
        for disk_slot in src:
            payload = self.staged.pop(disk_slot, None)
            if payload is None:
                for p in payloads:
                    self.store.buffers.give(p)
                raise KVCacheError(f"internal: window {self.window}: disk slot {disk_slot} was promoted "
                                   f"without being read and checked first")
            payloads.append(payload)
        copy_rows([host_bytes[h] for h in dst], [torch.frombuffer(p, dtype=torch.uint8) for p in payloads])
        for payload in payloads:
            self.store.buffers.give(payload)

    def end_call(self) -> list[int]:
        """Forget what was staged; return (and forget) the refused writes' disk slots."""
        self.forget()
        refused, self.refused = self.refused, []
        return refused


def copy_rows(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i] <- src[i] in one call: the GIL is given up (and won back from the disk threads) once."""
    if dst:
        torch._foreach_copy_(dst, src)
