"""The KV sender of a tensor-parallel context server's ranks 1..N-1 (bytes only, no CUDA IPC).

Rank 0 keeps the leases and sends their slots to the other ranks (server/tp/). A rank serves pulls
of its own kv heads from them (`offer`) until rank 0 ends the lease (`end` returns once the socket
thread reads them no more). A part of a pull that comes before its offer waits `PARK_S`.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from kvcache import KVCacheManager
from transceiver.config import TransceiverConfig
from transceiver.sender.kv_sender import KVSender
from transceiver.sender.lease import Ended, Offer, OfferedWindow, Withdraw, ready_event

log = logging.getLogger(__name__)

PARK_S = 30.0  # a pull may reach this rank before rank 0's offer does (this rank was busy computing)
END_TIMEOUT_S = 10.0


class RankSender(KVSender):
    """A `KVSender` whose leases are rank 0's: it serves the slots it is offered, pins nothing."""

    def __init__(self, kv: KVCacheManager, config: TransceiverConfig, fingerprint: str, epoch: str,
                 kv_heads: tuple[int, int]) -> None:
        """`epoch`: the server's (rank 0's); `kv_heads`: (first kv head held, the model's kv heads)."""
        super().__init__(kv, msgspec.structs.replace(config, same_host_ipc=False), fingerprint, epoch=epoch,
                         kv_heads=kv_heads, park_s=PARK_S)
        self._offered: set[str] = set()
        self._frames: list[zmq.MessageTracker] = []  # zero-copy frames of ended leases still with zmq

    def offer(self, cid: str, slots: dict[int, list[int]]) -> None:
        windows = {w: OfferedWindow(self._pools[w], s, self._kv.slot_bytes(w)) for w, s in slots.items()}
        self._thread.submit(Offer(cid, windows, ready_event(self._pools)))
        self._offered.add(cid)

    def end(self, cid: str) -> None:
        """Rank 0 ended the lease: a pull still running fails; returns once its slots are read no more."""
        if cid not in self._offered:
            return
        self._thread.submit(Withdraw(cid, "cancelled", "the lease ended on the context server"))
        deadline = time.monotonic() + END_TIMEOUT_S
        while cid in self._offered and time.monotonic() < deadline:
            self._thread.wait(0.01)
            self.step()
        while any(not t.done for t in self._frames) and time.monotonic() < deadline:
            time.sleep(0.001)
        if cid in self._offered:
            log.warning("KV sender: the socket thread did not give lease %r back within %s s", cid, END_TIMEOUT_S)
            self._offered.discard(cid)

    def step(self) -> None:
        for item in self._thread.drain():
            if isinstance(item, Ended):
                self._offered.discard(item.cid)
                self._frames += item.trackers
        self._frames = [t for t in self._frames if not t.done]

    @property
    def busy(self) -> bool:
        return bool(self._offered)

    def close(self) -> None:
        self._thread.close()
