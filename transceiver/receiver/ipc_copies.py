"""The generation side's same-GPU copies (CUDA IPC): queued on a side stream, checked once done.

`start` queues an `IpcChunk`'s copy and checksum on a side stream after the engine's earlier work;
`settled()` hands back finished ones (a watcher thread wakes an idle engine, `notify`). No late
writer: `abandon(pull_id)` makes the engine's stream wait for that pull's copies (the host does
not), which are kept until done (the peer's pool they read must stay mapped).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from transceiver.ipc import DeviceSum, start_copy
from transceiver.wire import IpcChunk


@dataclass(eq=False)
class Copy:
    pull_id: int
    chunk: IpcChunk
    nbytes: int
    checksum: DeviceSum  # of the words as the copy read them
    issued: float = field(default_factory=time.monotonic)
    abandoned: bool = False


class IpcCopies:
    """Copies of IpcChunks on the device, in the order they were started (engine thread only)."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self._copies: list[Copy] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._notify = notify
        self._watch: queue.SimpleQueue[DeviceSum | None] | None = None
        self._watcher: threading.Thread | None = None

    def start(self, pull_id: int, chunk: IpcChunk, src: torch.Tensor, dst: torch.Tensor, dst_slots: list[int],
              nbytes: int) -> None:
        """dst[dst_slots[i]] = src[chunk.slots[i]] and its checksum, queued (CPU: done at once)."""
        if not dst.is_cuda:
            checksum = start_copy(src, chunk.slots, dst, dst_slots, chunk.first)
        else:
            stream = self._stream(dst.device)
            stream.wait_stream(torch.cuda.current_stream(dst.device))
            with torch.cuda.device(dst.device), torch.cuda.stream(stream):
                checksum = start_copy(src, chunk.slots, dst, dst_slots, chunk.first)
            self._watched(checksum)
        self._copies.append(Copy(pull_id, chunk, nbytes, checksum))

    def pending(self, pull_id: int) -> bool:
        return any(c.pull_id == pull_id and not c.abandoned for c in self._copies)

    def settled(self) -> list[Copy]:
        """Finished copies of live pulls, taken out in start order (finished abandoned ones dropped)."""
        running: list[Copy] = []
        done: list[Copy] = []
        for c in self._copies:
            (done if c.checksum.done() else running).append(c)
        self._copies = running
        return [c for c in done if not c.abandoned]

    def abandon(self, pull_id: int) -> None:
        """The pull ended: later engine work on its blocks runs after its copies (GPU-side)."""
        for c in self._copies:
            if c.pull_id == pull_id and not c.abandoned:
                c.abandoned = True
                c.checksum.order_before_current()

    def close(self) -> None:
        if self._watch is not None and self._watcher is not None:
            self._watch.put(None)
            self._watcher.join(5.0)
        self._watch = self._watcher = None

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _watched(self, checksum: DeviceSum) -> None:
        if self._watch is None:
            self._watch = queue.SimpleQueue()
            self._watcher = threading.Thread(target=self._watch_loop, args=(self._watch,),
                                             name="kv-receiver-copies", daemon=True)
            self._watcher.start()
        self._watch.put(checksum)

    def _watch_loop(self, watch: queue.SimpleQueue[DeviceSum | None]) -> None:
        while (checksum := watch.get()) is not None:
            checksum.synchronize()
            if self._notify is not None:
                self._notify()
