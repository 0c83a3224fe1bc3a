"""Context side: leases a finished prefill's blocks for a pull (`KVSender`, the engine thread's half).

The engine thread pins a lease's blocks (onboarding offloaded ones) and offers their primary slots
(stable while pinned) to the socket thread (`SenderLink`, `serve.py`), which serves pulls without
waiting for the engine. It hands each lease back (`Ended`) with the trackers of frames in flight;
the engine unpins once zmq released them (if the socket thread died, at once). Same-GPU receivers
get the pools exported here (`ExportRequest`), under the pool lock the slot reads hold.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import msgspec
import zmq

from kvcache import KVCacheManager, Level
from transceiver.config import TransceiverConfig
from transceiver.ipc import export_pools, ipc_identity
from transceiver.link import LinkOwner, SocketThread
from transceiver.payload import wait_any
from transceiver.sender.lease import (
    PENDING,
    RELEASED,
    Ended,
    Extend,
    Lease,
    Offer,
    OfferedWindow,
    Started,
    Withdraw,
    ready_event,
)
from transceiver.sender.link import ExportRequest, Outgoing, SenderLink
from transceiver.stats import TransferStats
from transceiver.wire import RankEndpoint, layout_of

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 1.0  # how long `close` lets running pulls learn that they failed


class KVSender(LinkOwner):

    def __init__(self, kv: KVCacheManager, config: TransceiverConfig, fingerprint: str,
                 on_message: Callable[[], None] | None = None, *, epoch: str | None = None,
                 kv_heads: tuple[int, int] | None = None, other_ranks: list[RankEndpoint] | None = None,
                 park_s: float = 0.0) -> None:
        """`on_message()` (socket thread): items await `step`. Rank 0 of a tensor-parallel server passes
        the server's `epoch`, its `kv_heads` (first held, the model's) and `other_ranks` (tp.py); `park_s`:
        see `SenderLink`."""
        self._kv = kv
        self._config = config
        self.epoch = epoch or uuid.uuid4().hex  # new per process start: a pull for an older epoch fails
        self.stats = TransferStats()
        self._leases: dict[str, Lease] = {}
        self._unpin_later: list[tuple[list[zmq.MessageTracker], dict[int, list[int]]]] = []
        self._pools = {w: kv.pool(w, Level.PRIMARY) for w in kv.window_sizes}
        self.ipc_identity = ipc_identity(self._pools, config.same_host_ipc)  # None: bytes only
        self.ipc_exports = 0  # handshakes answered with an export of the pools
        self._pool_lock = threading.Lock()  # exports (here) vs slot reads (socket thread)
        layout = layout_of(kv, self._pools, fingerprint, kv_heads)
        self._link = SenderLink(config, self.epoch, layout, self.stats, self.ipc_identity,
                                pool_lock=self._pool_lock, ipc_offered=lambda: self.ipc_exports > 0,
                                other_ranks=other_ranks, park_s=park_s)
        self._thread = SocketThread("kv-sender", self._link, notify=on_message)
        self._thread.start()
        self.endpoint = self._link.endpoint

    # ---- engine thread API -------------------------------------------------------------------

    def add_lease(self, ctx_request_id: str, blocks: dict[int, list[int]]) -> None:
        """Pin `blocks` (window -> block ids, -1: released) for kv_transfer_timeout_ms; offer their slots."""
        unknown = set(blocks) - set(self._kv.window_sizes)
        if unknown:
            raise ValueError(f"unknown window sizes {sorted(unknown)}; valid: {sorted(self._kv.window_sizes)}")
        lease = self._new_lease(ctx_request_id, blocks)
        try:
            windows = {w: OfferedWindow(self._pools[w], self._pin(lease, w, ids), self._kv.slot_bytes(w))
                       for w, ids in blocks.items()}
            self._thread.submit(Offer(ctx_request_id, windows, ready_event(self._pools)))
        except Exception:
            self._unpin(lease.pinned)
            raise
        self._leases[ctx_request_id] = lease

    def open_stream(self, ctx_request_id: str, num_blocks: dict[int, int]) -> None:
        """Lease a request still prefilling: `num_blocks` per window, pending until `extend_stream`."""
        lease = self._new_lease(ctx_request_id, num_blocks)
        windows = {w: OfferedWindow(self._pools[w], [PENDING] * n, self._kv.slot_bytes(w))
                   for w, n in num_blocks.items()}
        self._thread.submit(Offer(ctx_request_id, windows, final=False))
        self._leases[ctx_request_id] = lease

    def extend_stream(self, ctx_request_id: str, blocks: dict[int, tuple[int, list[int]]], *, final: bool = False,
                      first_tokens: tuple[int, ...] = (), cached_tokens: int = 0) -> bool:
        """Pin and offer more blocks of a streamed lease (window -> (index of the first, their ids));
        `final` with the first tokens. False (nothing pinned) when the lease has ended."""
        lease = self._leases.get(ctx_request_id)
        if lease is None or lease.withdrawn:
            return False
        windows = {w: (first, self._pin(lease, w, ids)) for w, (first, ids) in blocks.items()}
        lease.deadline = time.monotonic() + self._config.timeout_s  # the prefill goes on: renewed
        self._thread.submit(Extend(ctx_request_id, windows, ready_event(self._pools), final, tuple(first_tokens),
                                   cached_tokens))
        return True

    def _new_lease(self, ctx_request_id: str, windows: dict[int, object]) -> Lease:
        if ctx_request_id in self._leases:
            raise ValueError(f"ctx_request_id {ctx_request_id!r} already has a lease")
        return Lease(time.monotonic() + self._config.timeout_s, {w: [] for w in windows})

    def _pin(self, lease: Lease, window: int, ids: list[int]) -> list[int]:
        """Pin the blocks (onboarding offloaded ones; OutOfBlocksError first), then their primary slots."""
        live = [b for b in ids if b >= 0]
        self._kv.pin_blocks(live, window)
        lease.pinned[window] += live
        slots = iter(self._kv.get_memory_pool_block_indices(live, window, require_primary=True))
        return [next(slots) if b >= 0 else RELEASED for b in ids]

    def drop_lease(self, ctx_request_id: str) -> None:
        """Engine abort: end the lease now (a running pull fails; a parked streamed pull is refused)."""
        if ctx_request_id in self._leases:
            self._withdraw(ctx_request_id, "cancelled", "the context server aborted the request")
            return
        with contextlib.suppress(RuntimeError):  # the parked pull then fails when its wait ends
            self._thread.submit(Withdraw(ctx_request_id, "cancelled", "the context server aborted the request"),
                                timeout_s=0.1)

    def step(self) -> None:
        """Every engine tick, idle or not: take back ended leases, reap expired ones, unpin."""
        self._take_items()
        if not self._thread.running and self._leases:  # nothing reads the leases' slots any more
            log.error("KV sender: the socket thread stopped; releasing %d leases", len(self._leases))
            for lease in self._leases.values():
                self._unpin(lease.pinned)
            self._leases.clear()
        now = time.monotonic()
        for cid, lease in list(self._leases.items()):
            if lease.deadline <= now and not lease.withdrawn:  # counted where it ends (serve.py)
                self._withdraw(cid, "lease_expired", "the context server's lease on the KV blocks expired")
        waiting = []  # ended leases are unpinned once zmq has released every frame made from their slots
        for trackers, pinned in self._unpin_later:
            if all(t.done for t in trackers):
                self._unpin(pinned)
            else:
                waiting.append((trackers, pinned))
        self._unpin_later = waiting

    def wait(self, timeout_s: float) -> None:
        """Block until `step` has something to do (an item, or frames of ended leases released)."""
        if self._unpin_later:
            wait_any([t for trackers, _ in self._unpin_later for t in trackers], timeout_s)
        else:
            self._thread.wait(timeout_s)

    @property
    def busy(self) -> bool:
        """True while ended leases wait for zmq to release their frames (`step` again soon)."""
        return bool(self._unpin_later)

    @property
    def lease_ids(self) -> frozenset[str]:
        """Leases not yet ended (their blocks pinned, their slots served)."""
        return frozenset(self._leases)

    @property
    def num_leases(self) -> int:
        """Leases whose blocks are still pinned (including ended ones waiting for zmq)."""
        return len(self._leases) + len(self._unpin_later)

    def pinned_blocks(self) -> dict[int, Counter[int]]:
        """Window -> pins per block id of every lease (the engine's health check compares them)."""
        out: dict[int, Counter[int]] = {}
        for pinned in self._all_pinned():
            for window, ids in pinned.items():
                out.setdefault(window, Counter()).update(ids)
        return out

    def expired_leases(self, now: float) -> list[str]:
        """Leases past their deadline (`step` reaps them at once: one that stays is stuck)."""
        return [cid for cid, lease in self._leases.items() if lease.deadline <= now]

    def close(self) -> None:
        """Fail running pulls, stop the socket thread, unpin every lease."""
        for cid in list(self._leases):
            self._withdraw(cid, "peer_gone", "the context server is shutting down")
        deadline = time.monotonic() + CLOSE_WAIT_S
        while (self._leases or self._link.has_pending_sends()) and time.monotonic() < deadline:
            self._take_items()
            time.sleep(0.005)  # give the Failed notices a moment to leave
        self._thread.close()  # closes the socket: zmq drops whatever it still held
        for pinned in self._all_pinned():
            self._unpin(pinned)
        self._leases.clear()
        self._unpin_later.clear()

    def _take_items(self) -> None:
        for item in self._thread.drain():
            try:
                self._on_item(item)
            except Exception:  # one broken item must not lose the others of the batch
                log.exception("KV sender: handling %r failed", item)

    def _on_item(self, item: Ended | Started | ExportRequest) -> None:
        if isinstance(item, ExportRequest):  # a receiver on our GPU: a fresh export of the pools for it (ipc.py)
            assert self.ipc_identity is not None
            with self._pool_lock:
                offer = export_pools(self._pools, self.ipc_identity)  # None: CUDA refused (logged), bytes then
            self.ipc_exports += offer is not None
            self._thread.submit(Outgoing(item.peer, msgspec.structs.replace(item.info, ipc=offer)))
        elif isinstance(item, Started):
            lease = self._leases.get(item.cid)
            if lease is not None and not lease.withdrawn:
                lease.deadline = time.monotonic() + self._config.timeout_s  # a live pull renews it
        elif isinstance(item, Ended):
            lease = self._leases.pop(item.cid, None)
            if lease is None:
                return
            busy = [t for t in item.trackers if not t.done]
            if busy:
                self._unpin_later.append((busy, lease.pinned))
            else:
                self._unpin(lease.pinned)

    def _withdraw(self, cid: str, reason: str, detail: str) -> None:
        """Ask the socket thread to end the lease (unpinned on `Ended`); if that fails, the next reap retries."""
        lease = self._leases.get(cid)
        if lease is None or lease.withdrawn:
            return
        try:
            self._thread.submit(Withdraw(cid, reason, detail), timeout_s=0.1)
        except RuntimeError as e:  # queue full, or the thread is gone (then `step` takes all back)
            log.warning("KV sender: could not withdraw lease %r yet: %s", cid, e)
            return
        lease.withdrawn = True

    def _all_pinned(self) -> list[dict[int, list[int]]]:
        return [lease.pinned for lease in self._leases.values()] + [p for _, p in self._unpin_later]

    def _unpin(self, pinned: dict[int, list[int]]) -> None:
        for window, ids in pinned.items():
            self._kv.unpin_blocks(ids, window)
