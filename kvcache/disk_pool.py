"""One window group's disk level as its pools see it: host rows <-> the disk store's files.

Blocks move between neighbouring levels only, so the copies that touch the disk are host -> disk
(a host block evicted to disk) and disk -> host (a disk block promoted on a hit). `GroupPools`
hands both here, in the order the block manager recorded them, after any DMA still using those
host rows has finished.

- host -> disk: each row is copied into a buffer of the store's (the host slots are reused at once;
  reused buffers: no page faults, kvcache/disk_buffers.py) and queued for its file with what the
  file must say about its block (`describe`: the block now in that disk slot; none when the block
  left it within the same call). A write the queue refuses is listed in `refused`: its block has
  no bytes, and the tier drops it.
- disk -> host: the bytes were read and checked before the block manager promoted the block
  (`stage`, by kvcache/disk_tier.py); they are copied into the host rows, and their buffers given
  back. What was staged and not used is given back at the end of the call (`end_call`).
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

    def stage(self, slot: int, payload: memoryview) -> None:
        """Keep a checked payload (a buffer of the store's, now this object's) for the copy of `slot`."""
        old = self.staged.pop(slot, None)
        if old is not None and old is not payload:
            self.store.buffers.give(old)
        self.staged[slot] = payload

    def forget(self) -> None:
        """Give back every staged payload."""
        for payload in self.staged.values():
            self.store.buffers.give(payload)
        self.staged.clear()

    def write(self, host_rows: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Queue host rows `src` for disk slots `dst` (host_rows: [num_host_slots, words])."""
        host_bytes = host_rows.view(torch.uint8)  # [num_host_slots, slot_bytes]
        for host_slot, slot in zip(src, dst, strict=True):
            meta = self.describe(slot)
            if meta is None:
                continue  # dropped again within the call: nothing to keep
            buf = self.store.buffers.take(host_bytes.shape[1])
            torch.frombuffer(buf, dtype=torch.uint8).copy_(host_bytes[host_slot])
            if not self.store.write(self.window, slot, meta, buf):
                self.store.buffers.give(buf)
                self.refused.append(slot)

    def read(self, host_rows: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Copy the staged bytes of disk slots `src` into host rows `dst`."""
        host_bytes = host_rows.view(torch.uint8)  # [num_host_slots, slot_bytes]
        for disk_slot, host_slot in zip(src, dst, strict=True):
            payload = self.staged.pop(disk_slot, None)
            if payload is None:
                raise KVCacheError(f"internal: window {self.window}: disk slot {disk_slot} was promoted "
                                   f"without being read and checked first")
            host_bytes[host_slot].copy_(torch.frombuffer(payload, dtype=torch.uint8))
            self.store.buffers.give(payload)

    def end_call(self) -> list[int]:
        """Forget what was staged; return (and forget) the refused writes' disk slots."""
        self.forget()
        refused, self.refused = self.refused, []
        return refused
