"""One window group's disk level as its pools see it: host rows <-> the disk store's files.

Blocks move between neighbouring levels only, so the copies that touch the disk are host -> disk
(a host block evicted to disk) and disk -> host (a disk block promoted on a hit). `GroupPools`
hands both here, in the order the block manager recorded them, after any DMA still using those
host rows has finished.

- host -> disk: the rows are gathered into a fresh tensor (the host slots are reused at once) and
  each row is queued for its file with what the file must say about its block (`describe`: the
  block now in that disk slot; none when the block left it within the same call). A write the
  queue refuses is listed in `refused`: its block has no bytes, and the tier drops it.
- disk -> host: the bytes were read and checked before the block manager promoted the block
  (`stage`, by kvcache/disk_tier.py); they are copied into the host rows. What was staged and
  not used is forgotten at the end of the call (`end_call`).
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
        self.staged[slot] = payload

    def write(self, host_rows: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Queue host rows `src` for disk slots `dst` (host_rows: [num_host_slots, words])."""
        index = torch.tensor(src, dtype=torch.int64)
        rows = host_rows.index_select(0, index).view(torch.uint8).numpy()  # [n, slot_bytes], a copy
        for i, slot in enumerate(dst):
            meta = self.describe(slot)
            if meta is None:
                continue  # dropped again within the call: nothing to keep
            if not self.store.write(self.window, slot, meta, memoryview(rows[i])):
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

    def end_call(self) -> list[int]:
        """Forget what was staged; return (and forget) the refused writes' disk slots."""
        self.staged.clear()
        refused, self.refused = self.refused, []
        return refused
