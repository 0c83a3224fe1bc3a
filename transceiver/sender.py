"""Context side: leases a finished prefill's blocks and serves pulls for them (`KVSender`).

Threads: the engine thread calls every public method and owns the KV manager and all tensor work
(gather into staging buffers); the socket thread (`link.SocketThread`) owns the ROUTER socket,
checks every incoming message (`codec.py`) and answers handshakes on its own.

Ownership: `add_lease` pins the request's blocks. They are unpinned exactly once, by
`_end_lease`, when the receiver acknowledges, cancels, disconnects, the lease expires (checked
every `step`), the engine drops it, or the sender closes. A pinned block is never evicted or
offloaded, so its primary slot is stable while the lease lives. Large blocks of a CPU pool are
sent as zero-copy frames of the pool itself; a lease that ends while such frames are still with
zmq is unpinned only once zmq has released them (`_unpin_later`), so a slot is never rewritten
under a frame in flight.

Same-GPU receivers (CUDA IPC, `ipc.py`): the pools are exported for each such receiver's
handshake (here, on the engine thread: `ExportRequest`); a pull with `via_ipc` is answered at
once, after a device synchronize, with the blocks' primary slots and checksums (`IpcChunk`s, then
`Done`), and the receiver copies them itself. The lease, its pins and its end (Ack,
Cancel, expiry, ...) are the same as on the byte path.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from kvcache import KVCacheManager, Level, OutOfBlocksError
from transceiver.config import TransceiverConfig
from transceiver.ipc import ipc_identity, slots_checksum, synchronize, try_export
from transceiver.layout import layout_of
from transceiver.lease import Job, Lease
from transceiver.link import SocketThread
from transceiver.messages import (
    Ack,
    Cancel,
    ChunkHeader,
    Done,
    Failed,
    IpcChunk,
    PullRequest,
    WindowRange,
)
from transceiver.payload import (
    ChunkPlan,
    StagingPool,
    checksum,
    frame_bounds,
    gather,
    plan_chunks,
    pool_views,
    tracked_frames,
    wait_any,
)
from transceiver.sender_link import ExportRequest, Incoming, Outgoing, PeerGone, SenderLink
from transceiver.stats import TransferStats

log = logging.getLogger(__name__)

STAGING_BUFFERS = 4  # gathered chunks in flight per sender (each max_chunk_bytes)
MAX_INFLIGHT = 4  # chunks handed to zmq and not yet released by it, staged or zero-copy
CHUNKS_PER_STEP = 4  # bounds the engine thread's time in one `step`
CHUNKS_PER_PULL = 8  # aim: a pull in at least this many chunks ...
MIN_CHUNK_TARGET = 1 << 20  # ... of at least this many bytes (up to max_chunk_bytes)
ZERO_COPY_SLOT_BYTES = 1 << 20  # CPU-pool blocks this large go out as frames of the pool itself
MAX_IPC_SLOTS = 4096  # slots per IpcChunk: its header stays well under codec.MAX_HEADER_BYTES


def _ipc_parts(r: WindowRange) -> list[WindowRange]:
    """`r` cut into ranges of at most MAX_IPC_SLOTS blocks."""
    end = r.first + r.count
    return [WindowRange(window=r.window, first=first, count=min(MAX_IPC_SLOTS, end - first))
            for first in range(r.first, end, MAX_IPC_SLOTS)]


class KVSender:
    """Serves pulls of leased KV blocks over a ROUTER bound on `config.host`."""

    def __init__(self, kv: KVCacheManager, config: TransceiverConfig, fingerprint: str,
                 on_message: Callable[[], None] | None = None) -> None:
        """`on_message()` is called (from the socket thread) whenever messages await `step`."""
        self._kv = kv
        self._config = config
        self.epoch = uuid.uuid4().hex  # new per process start: a pull for an older epoch fails
        self.stats = TransferStats()
        self._leases: dict[str, Lease] = {}
        self._active: deque[str] = deque()  # ctx_request_ids whose job still has chunks or Done to send
        pin = any(kv.pool(w, Level.PRIMARY).is_cuda for w in kv.window_sizes)
        self._staging = StagingPool(config.max_chunk_bytes, STAGING_BUFFERS, pin)
        self._inflight: list[zmq.MessageTracker] = []  # every chunk zmq has not released yet
        self._unpin_later: list[tuple[list[zmq.MessageTracker], dict[int, list[int]]]] = []
        self._pools = {w: kv.pool(w, Level.PRIMARY) for w in kv.window_sizes}
        self.ipc_identity = ipc_identity(self._pools, config.same_host_ipc)  # None: bytes only
        self.ipc_exports = 0  # handshakes answered with an export of the pools
        self._link = SenderLink(config, self.epoch, layout_of(kv, fingerprint), self.stats, self.ipc_identity)
        self._thread = SocketThread("kv-sender", self._link, notify=on_message)
        self._thread.start()
        self.endpoint = self._link.endpoint

    # ---- engine thread API -------------------------------------------------------------------

    def add_lease(self, ctx_request_id: str, blocks: dict[int, list[int]], num_tokens: int) -> None:
        """Pin `blocks` (window -> block ids; block i covers prompt tokens [i*tpb, (i+1)*tpb);
        -1 = released, not sendable) for at most kv_transfer_timeout_ms."""
        if ctx_request_id in self._leases:
            raise ValueError(f"ctx_request_id {ctx_request_id!r} already has a lease")
        unknown = set(blocks) - set(self._kv.window_sizes)
        if unknown:
            valid = sorted(self._kv.window_sizes)
            raise ValueError(f"unknown window sizes {sorted(unknown)}; valid: {valid}")
        lease = Lease({w: list(ids) for w, ids in blocks.items()}, num_tokens,
                       time.monotonic() + self._config.timeout_s)
        try:
            for window, ids in lease.blocks.items():
                live = [b for b in ids if b >= 0]
                self._kv.pin_blocks(live, window)  # may onboard; raises OutOfBlocksError before pinning
                lease.pinned[window] = live
        except Exception:
            for window, live in lease.pinned.items():
                self._kv.unpin_blocks(live, window)
            raise
        self._leases[ctx_request_id] = lease

    def drop_lease(self, ctx_request_id: str) -> None:
        """Engine abort: release the lease now (a running pull is told it failed)."""
        if ctx_request_id in self._leases:
            self._end_lease(ctx_request_id, "cancelled", "the context server aborted the request")

    def step(self) -> None:
        """Every engine tick, idle or not: apply messages, send chunks, reap expired leases."""
        for item in self._thread.drain():
            self._on_item(item)
        self._pump()
        self._reap(time.monotonic())
        self._unpin_released()

    def wait(self, timeout_s: float) -> None:
        """Block until `step` has something to do (a message, room for a chunk) or timeout."""
        if self._active and not self._room():
            wait_any(self._inflight, timeout_s)
        elif not self._active:
            self._thread.wait(timeout_s)

    @property
    def busy(self) -> bool:
        """True while chunks are waiting to be sent (a caller should `step` again soon)."""
        return bool(self._active)

    @property
    def num_leases(self) -> int:
        """Leases whose blocks are still pinned (including ended ones waiting for zmq)."""
        return len(self._leases) + len(self._unpin_later)

    def close(self) -> None:
        """Fail running pulls, unpin every lease, stop the socket thread."""
        for cid in list(self._leases):
            self._end_lease(cid, "peer_gone", "the context server is shutting down")
        deadline = time.monotonic() + 1.0
        while self._link.has_pending_sends() and time.monotonic() < deadline:
            time.sleep(0.005)  # give the Failed notices a moment to leave
        self._thread.close()  # closes the socket: zmq drops whatever it still held
        for _, pinned in self._unpin_later:
            self._unpin(pinned)
        self._unpin_later.clear()

    # ---- messages ----------------------------------------------------------------------------

    def _on_item(self, item: Incoming | ExportRequest | PeerGone) -> None:
        if isinstance(item, ExportRequest):
            self._answer_with_export(item)
            return
        if isinstance(item, PeerGone):
            for cid, lease in list(self._leases.items()):
                if lease.job is not None and lease.job.peer == item.peer:
                    self._end_lease(cid, "peer_gone", "the receiver disconnected", notify=False)
            return
        body = item.body
        if isinstance(body, PullRequest):
            self._start_job(item.peer, body)
        elif isinstance(body, Ack):
            lease = self._leases.get(body.ctx_request_id)
            job = lease.job if lease is not None else None
            if job is not None and job.pull_id == body.pull_id and job.done_sent:
                self._end_lease(body.ctx_request_id, None, "")
                self.stats.count_ok(time.monotonic() - job.started, job.sent_bytes)
        elif isinstance(body, Cancel):
            if body.ctx_epoch not in (None, self.epoch) or body.ctx_request_id not in self._leases:
                return
            self._end_lease(body.ctx_request_id, "cancelled", "the receiver cancelled", notify=False)

    def _answer_with_export(self, req: ExportRequest) -> None:
        """Handshake of a receiver on our GPU: a fresh export of the pools for it (see `ipc.py`)."""
        assert self.ipc_identity is not None
        offer = try_export(self._pools, self.ipc_identity)  # None: CUDA refused (logged), bytes then
        self.ipc_exports += offer is not None
        self._thread.submit(Outgoing(req.peer, msgspec.structs.replace(req.info, ipc=offer)))

    def _start_job(self, peer: bytes, req: PullRequest) -> None:
        lease = self._leases.get(req.ctx_request_id)
        problem = self._check_pull(req, lease)
        if problem is not None:
            self.stats.count_failure(problem[0])
            self._reply_failed(peer, req.pull_id, *problem)
            return
        assert lease is not None
        lease.job = Job(peer, req.pull_id, deque(), time.monotonic())
        try:
            for r in req.ranges:
                self._kv.ensure_primary(lease.range_ids(r), r.window)
        except OutOfBlocksError as e:
            self._end_lease(req.ctx_request_id, "out_of_blocks", f"cannot onboard offloaded blocks: {e}")
            return
        lease.deadline = time.monotonic() + self._config.timeout_s  # a live pull renews the lease
        if req.via_ipc:
            self._serve_ipc(req.ctx_request_id, lease, req.ranges)
            return
        sizes = {r.window: self._kv.slot_bytes(r.window) for r in req.ranges}
        total = sum(r.count * sizes[r.window] for r in req.ranges)
        # small pulls in smaller chunks: the receiver's work on the last chunk is not overlapped
        target = min(self._config.max_chunk_bytes, max(MIN_CHUNK_TARGET, total // CHUNKS_PER_PULL))
        lease.job.chunks = deque(c for r in req.ranges
                                 for c in plan_chunks(r.window, r.first, r.count, sizes[r.window], target))
        self._active.append(req.ctx_request_id)

    def _check_pull(self, req: PullRequest, lease: Lease | None) -> tuple[str, str] | None:
        if req.ctx_epoch != self.epoch:
            return "epoch_mismatch", (
                f"context server restarted: the request was prefilled by epoch {req.ctx_epoch}, "
                f"this is epoch {self.epoch}"
            )
        if lease is None:
            return "unknown_request", (
                f"no lease for ctx_request_id {req.ctx_request_id!r} (unknown, expired or released)")
        if lease.job is not None:
            return "bad_request", f"a pull for {req.ctx_request_id!r} is already running"
        if req.via_ipc and self.ipc_exports == 0:
            return "bad_request", "the pull asks for CUDA IPC, which this context server never offered"
        problem = lease.range_problem(req.ranges)
        return None if problem is None else ("bad_request", problem)

    # ---- data path -----------------------------------------------------------------------------

    def _serve_ipc(self, cid: str, lease: Lease, ranges: list[WindowRange]) -> None:
        """Same-GPU pull: every block's primary slot and checksum, sent once all writes to them
        (prefill, onboard) have finished on the device, then Done; the receiver copies, then Acks."""
        job = lease.job
        assert job is not None
        try:
            chunks = [self._ipc_chunk(lease, job.pull_id, part) for r in ranges for part in _ipc_parts(r)]
            for device in {self._kv.pool(r.window, Level.PRIMARY).device for r in ranges}:
                synchronize(device)
        except Exception as e:  # a broken invariant must fail this pull, not the engine loop
            log.exception("KV sender: IPC pull %d of %r failed", job.pull_id, cid)
            self._end_lease(cid, "internal_error", f"the context server failed to read the blocks: {e}")
            return
        for chunk in chunks:
            self._thread.submit(Outgoing(job.peer, chunk))
        job.sent_bytes = sum(r.count * self._kv.slot_bytes(r.window) for r in ranges)
        job.sent_chunks = len(chunks)
        self._thread.submit(Outgoing(job.peer, Done(pull_id=job.pull_id, total_bytes=job.sent_bytes,
                                                    chunks=job.sent_chunks)))
        job.done_sent = True
        self.stats.bytes_sent += job.sent_bytes
        self.stats.ipc_transfers += 1

    def _ipc_chunk(self, lease: Lease, pull_id: int, r: WindowRange) -> IpcChunk:
        # translate only now, like `_send_chunk`: the slot is where the bytes are
        slots = self._kv.get_memory_pool_block_indices(lease.range_ids(r), r.window, require_primary=True)
        digest = slots_checksum(self._kv.pool(r.window, Level.PRIMARY), slots, r.first)
        return IpcChunk(pull_id=pull_id, window=r.window, first=r.first, slots=slots, checksum=digest)

    def _pump(self) -> None:
        """Gather and hand over chunks while staging buffers are free; Done after the last one."""
        budget = CHUNKS_PER_STEP
        while self._active and budget > 0 and self._room():
            cid = self._active[0]
            lease = self._leases[cid]
            job = lease.job
            assert job is not None
            if not job.chunks:
                total = Done(pull_id=job.pull_id, total_bytes=job.sent_bytes, chunks=job.sent_chunks)
                self._thread.submit(Outgoing(job.peer, total))
                job.done_sent = True
                self._active.popleft()
                continue
            budget -= 1
            try:
                if not self._send_chunk(lease, job, job.chunks[0]):
                    return  # no staging buffer free
            except Exception as e:  # a broken invariant must fail this pull, not the engine loop
                log.exception("KV sender: pull %d of %r failed", job.pull_id, cid)
                self._end_lease(cid, "internal_error", f"the context server failed to read the blocks: {e}")
                continue
            job.chunks.popleft()

    def _room(self) -> bool:
        self._inflight = [t for t in self._inflight if not t.done]
        return len(self._inflight) < MAX_INFLIGHT

    def _send_chunk(self, lease: Lease, job: Job, plan: ChunkPlan) -> bool:
        """Hand one chunk to the socket thread; False (nothing done) when no staging buffer is free."""
        ids = lease.blocks[plan.window][plan.first : plan.first + plan.count]
        # translate only now: the slot is where the bytes are; a non-primary block raises here
        slots = self._kv.get_memory_pool_block_indices(ids, plan.window, require_primary=True)
        pool = self._kv.pool(plan.window, Level.PRIMARY)
        max_frame = self._config.max_chunk_bytes
        if pool.device.type == "cpu" and plan.slot_bytes >= ZERO_COPY_SLOT_BYTES:
            parts = [v[s:e] for v in pool_views(pool, slots) for s, e in frame_bounds(v.size, max_frame)]
            frames, tracker = tracked_frames(parts)
            lease.pool_frames.append(tracker)
        else:
            i = self._staging.acquire()
            if i is None:
                return False
            gather(pool, slots, self._staging.buffer(i))
            bounds = frame_bounds(plan.nbytes, max_frame)
            parts = self._staging.parts(i, bounds)
            frames, tracker = self._staging.frames(i, bounds)
        digest = checksum(parts, plan.slot_bytes, plan.first)
        header = ChunkHeader(pull_id=job.pull_id, window=plan.window, first=plan.first, count=plan.count,
                             nbytes=plan.nbytes, checksum=digest)
        self._thread.submit(Outgoing(job.peer, header, frames))
        self._inflight.append(tracker)
        job.sent_bytes += plan.nbytes
        job.sent_chunks += 1
        self.stats.bytes_sent += plan.nbytes
        return True

    # ---- lease end -----------------------------------------------------------------------------

    def _reap(self, now: float) -> None:
        for cid in [c for c, lease in self._leases.items() if lease.deadline <= now]:
            self.stats.lease_expired += 1
            self._end_lease(cid, "lease_expired", "the context server's lease on the KV blocks expired")

    def _end_lease(self, cid: str, reason: str | None, detail: str, notify: bool = True) -> None:
        """The only place that unpins: pops the lease, so it runs once per lease."""
        lease = self._leases.pop(cid)
        if cid in self._active:
            self._active.remove(cid)
        busy = [t for t in lease.pool_frames if not t.done]
        if busy:
            self._unpin_later.append((busy, lease.pinned))
        else:
            self._unpin(lease.pinned)
        job = lease.job
        if job is not None and reason is not None:
            self.stats.count_failure(reason)
            if notify:
                self._reply_failed(job.peer, job.pull_id, reason, detail)

    def _unpin(self, pinned: dict[int, list[int]]) -> None:
        for window, ids in pinned.items():
            self._kv.unpin_blocks(ids, window)

    def _unpin_released(self) -> None:
        """Unpin ended leases once zmq has released every frame made from their slots."""
        waiting = []
        for trackers, pinned in self._unpin_later:
            if all(t.done for t in trackers):
                self._unpin(pinned)
            else:
                waiting.append((trackers, pinned))
        self._unpin_later = waiting

    def _reply_failed(self, peer: bytes, pull_id: int, reason: str, detail: str) -> None:
        self._thread.submit(Outgoing(peer, Failed(reason=reason, detail=detail, pull_id=pull_id)))
