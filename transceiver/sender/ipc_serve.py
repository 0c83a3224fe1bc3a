"""The context side's same-GPU pulls (CUDA IPC, socket thread): slots and checksums, no bytes.

`PullServer` queues each pull's checksums on its side stream; their `IpcChunk`s and `Done` leave
once `ready` says the device finished (the socket thread never waits). A pull that ends first is
dropped (its checksum may read unpinned slots: a value nobody reads).
"""

from __future__ import annotations

from dataclasses import dataclass

from transceiver.ipc import DeviceSum
from transceiver.wire import IpcChunk, WindowRange

MAX_IPC_SLOTS = 4096  # slots per IpcChunk: its header stays well under wire.MAX_HEADER_BYTES
POLL_S = 0.0002  # how soon the socket thread looks again while a checksum is on the device


@dataclass(frozen=True)
class IpcPart:
    """One future IpcChunk: blocks `range` of a lease, in the sender's `slots`, being summed."""

    range: WindowRange
    slots: list[int]
    checksum: DeviceSum

    def chunk(self, pull_id: int) -> IpcChunk:
        r = self.range
        return IpcChunk(pull_id=pull_id, window=r.window, first=r.first, slots=self.slots,
                        checksum=self.checksum.value())


class IpcPulls:
    """Pulls whose checksums are on the device, by (lease id, pull id), in arrival order; a pull's
    batches (one per `Extend` when streamed, Done after the `last`) come back in order."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], list[tuple[list[IpcPart], bool]]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, cid: str, pull_id: int, parts: list[IpcPart], last: bool = True) -> None:
        self._pending.setdefault((cid, pull_id), []).append((parts, last))

    def drop(self, cid: str) -> None:
        for key in [k for k in self._pending if k[0] == cid]:
            del self._pending[key]

    def ready(self) -> list[tuple[str, int, list[IpcPart], bool]]:
        """Batches whose every checksum is done, taken out (arrival order; per pull, in order)."""
        done = []
        for (cid, pull_id), batches in list(self._pending.items()):
            while batches and all(p.checksum.done() for p in batches[0][0]):
                parts, last = batches.pop(0)
                done.append((cid, pull_id, parts, last))
            if not batches:
                del self._pending[cid, pull_id]
        return done
