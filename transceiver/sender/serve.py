"""The context side's data path, on its socket thread: serve pulls from leased slots as they arrive.

Per pull: check it against the lease, then per chunk gather the slots into a staging buffer (big
CPU blocks: frames of the pool), checksum, send; then Done (same GPU: `ipc_serve.py`). CUDA reads
run on a side stream after the lease's `ready` event, under `pool_lock` (held by exports).

Every lease ends here exactly once (`_end`: Ack, Cancel, receiver gone, failure, `Withdraw`, or a
tensor-parallel `Release`) and goes back in `Ended`; an expiry is counted here, so one an Ack
ended first is not. Streamed leases (stream.py) are served as far as their blocks are written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import zmq

from transceiver.config import TransceiverConfig
from transceiver.ipc import start_checksum
from transceiver.link import SocketIO
from transceiver.payload import (
    StagingPool,
    checksum,
    frame_bounds,
    gather,
    plan_chunks,
    pool_views,
    tracked_frames,
)
from transceiver.sender.ipc_serve import MAX_IPC_SLOTS, POLL_S, IpcPart, IpcPulls
from transceiver.sender.lease import Ended, Extend, Job, Offer, Offered, Started, Withdraw
from transceiver.sender.stream import Pacer, complete, next_ranges
from transceiver.stats import TransferStats
from transceiver.tp import gather_heads, unit_bytes
from transceiver.wire import (
    Ack,
    Body,
    Cancel,
    ChunkHeader,
    Done,
    Failed,
    PullRequest,
    Release,
    WindowRange,
)

log = logging.getLogger(__name__)

STAGING_BUFFERS = 4  # gathered chunks in flight per sender (each max_chunk_bytes)
MAX_INFLIGHT = 4  # chunks handed to zmq and not yet released by it, staged or zero-copy
CHUNKS_PER_PUMP = 4  # then the socket thread looks at its sockets again
CHUNKS_PER_PULL = 8  # aim: a pull in at least this many chunks ...
MIN_CHUNK_TARGET = 1 << 20  # ... of at least this many bytes (up to max_chunk_bytes)
ZERO_COPY_SLOT_BYTES = 1 << 20  # CPU-pool blocks this large go out as frames of the pool itself
ROOM_POLL_S = 0.0005  # how soon to look again while zmq still holds MAX_INFLIGHT chunks

Send = Callable[[SocketIO, bytes, Body, list[Any]], None]  # (io, peer, body, payload frames)
Parked = tuple[bytes, PullRequest, float]  # a pull waiting for its lease's offer: (peer, pull, until)


class PullServer:
    def __init__(self, config: TransceiverConfig, epoch: str, stats: TransferStats, send: Send,
                 pool_lock: threading.Lock, ipc_offered: Callable[[], bool], park_s: float = 0.0) -> None:
        """`park_s` > 0: a tensor-parallel part (`keep_lease`) waits this long for its lease's offer
        (a rank whose offers come from rank 0, possibly after the pull)."""
        self._config, self._epoch, self._stats, self._send = config, epoch, stats, send
        self._pool_lock = pool_lock
        self._ipc_offered = ipc_offered  # has the engine exported the pools to anyone (this epoch)?
        self._offers: dict[str, Offered] = {}
        self._active: deque[tuple[str, int]] = deque()  # (lease, pull_id) with chunks or Done to send
        self._staging: StagingPool | None = None  # made on first use, pinned for CUDA pools
        self._inflight: list[zmq.MessageTracker] = []  # every chunk zmq has not released yet
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._park_s = park_s
        self._parked: dict[str, list[Parked]] = {}  # cid -> its pulls waiting for the offer
        # streamed leases ended or withdrawn before they opened: cid -> (until, reason, detail), to refuse a
        # later streamed pull at once
        self._dropped: dict[str, tuple[float, str, str]] = {}
        self._ipc = IpcPulls()  # same-GPU pulls whose checksums are on the device
        self._pacer = Pacer(config.test_link_delay_ms, config.test_link_bytes_per_s)  # test only

    # ---- from the engine -----------------------------------------------------------------------

    def offer(self, offer: Offer, io: SocketIO | None = None) -> None:
        """Serve pulls of the lease from now on (and the parked ones, through `io`)."""
        self._offers[offer.cid] = Offered(offer)
        for peer, req, _ in self._parked.pop(offer.cid, []) if io is not None else ():
            self.pull(io, peer, req)

    def expire_parked(self, io: SocketIO) -> None:
        """Fail the parked pulls whose offer did not come in time."""
        now = time.monotonic()
        self._dropped = {cid: d for cid, d in self._dropped.items() if d[0] > now}
        for cid in list(self._parked):
            for peer, req, _ in self._unpark(cid, lambda _peer, _req, until: until <= now):
                self._refuse(io, peer, req, ("unknown_request", f"no lease for ctx_request_id {cid!r} "
                                                                "reached this rank in time"))

    def extend(self, io: SocketIO, ext: Extend) -> None:
        """More blocks of a streamed lease are written: its pulls go on (an ended lease: nothing)."""
        off = self._offers.get(ext.cid)
        if off is None:
            return
        off.extend(ext)
        for job in list(off.jobs.values()):
            if ext.cid in self._offers:  # a broken pull ends the lease
                self._plan_more(io, ext.cid, off, job)

    def withdraw(self, io: SocketIO, w: Withdraw) -> None:
        if w.cid in self._offers:  # else it ended here already and its `Ended` is on the way
            self._end(io, w.cid, w.reason, w.detail)
        else:  # or it is a streamed lease that never opened
            self._dropped[w.cid] = (time.monotonic() + self._config.timeout_s, w.reason, w.detail)
        for peer, req, _ in self._parked.pop(w.cid, []):
            self._refuse(io, peer, req, (w.reason, w.detail))

    # ---- from receivers ------------------------------------------------------------------------

    def pull(self, io: SocketIO, peer: bytes, req: PullRequest) -> None:
        off = self._offers.get(req.ctx_request_id)
        park_s = self._config.timeout_s if req.stream else self._park_s if req.keep_lease else 0.0
        if off is None and req.stream and req.ctx_request_id in self._dropped:
            self._refuse(io, peer, req, self._dropped[req.ctx_request_id][1:])
            return
        if off is None and park_s > 0 and req.ctx_epoch == self._epoch:
            self._parked.setdefault(req.ctx_request_id, []).append((peer, req, time.monotonic() + park_s))
            return
        problem = self._pull_problem(peer, req, off)
        if problem is not None:
            self._refuse(io, peer, req, problem)
            return
        assert off is not None
        job = off.jobs[req.pull_id] = Job(peer, req.pull_id, deque(), time.monotonic(), heads=req.heads,
                                          keep_lease=req.keep_lease, ranges=list(req.ranges),
                                          planned=[r.first for r in req.ranges], via_ipc=req.via_ipc)
        io.deliver(Started(req.ctx_request_id))
        try:
            total = sum(r.count * self._unit_bytes(off, r.window, job) for r in req.ranges)
            # small pulls in smaller chunks: the receiver's work on the last chunk is not overlapped
            job.target = min(self._config.max_chunk_bytes, max(MIN_CHUNK_TARGET, total // CHUNKS_PER_PULL))
            self._plan_more(io, req.ctx_request_id, off, job)
        except Exception as e:
            self._broken(io, req.ctx_request_id, req.pull_id, e)

    def _plan_more(self, io: SocketIO, cid: str, off: Offered, job: Job) -> None:
        """Plan the blocks that can go out now; queue the pull if it has chunks or its Done is due."""
        ranges, problem = next_ranges(off, job)
        if problem is not None:
            self._end(io, cid, "bad_request", problem)
            return
        last = complete(off, job)
        if job.via_ipc:
            if (ranges or last) and not job.queued:
                self._serve_ipc(io, cid, off, job, ranges, last)
                job.queued = last
            return
        job.chunks.extend(c for r in ranges for c in plan_chunks(r, self._unit_bytes(off, r.window, job), job.target))
        if (job.chunks or last) and not job.queued:
            job.queued = True
            self._active.append((cid, job.pull_id))

    @staticmethod
    def _unit_bytes(off: Offered, window: int, job: Job) -> int:
        offered = off.offer.windows[window]
        if job.heads is None:
            return offered.slot_bytes
        return unit_bytes(offered.slot_bytes, offered.pool.shape[4], job.heads)

    def ack(self, io: SocketIO, body: Ack) -> None:
        off = self._offers.get(body.ctx_request_id)
        job = off.jobs.get(body.pull_id) if off is not None else None
        if job is None or not job.done_sent:
            return
        if job.keep_lease:
            del off.jobs[body.pull_id]
        else:
            self._end(io, body.ctx_request_id, None, "")
        self._stats.count_ok(time.monotonic() - job.started, job.sent_bytes)

    def release(self, io: SocketIO, body: Release) -> None:
        """Every part of a tensor-parallel pull arrived: the lease ends (a success, counted per part)."""
        if body.ctx_epoch == self._epoch and body.ctx_request_id in self._offers:
            self._end(io, body.ctx_request_id, None, "")

    def cancel(self, io: SocketIO, peer: bytes, body: Cancel) -> None:
        """End the lease (and drop the peer's parked pulls), unless the Cancel names a pull it never
        served while others run (a refused duplicate, or a tensor-parallel part that ended here)."""
        if body.ctx_request_id in self._parked:
            self._unpark(body.ctx_request_id, lambda p, req, _: p == peer and body.pull_id in (None, req.pull_id))
        off = self._offers.get(body.ctx_request_id)
        if off is None or body.ctx_epoch not in (None, self._epoch):
            return
        if body.pull_id is not None and off.jobs and body.pull_id not in off.jobs:
            return
        self._end(io, body.ctx_request_id, "cancelled", "the receiver cancelled", skip=peer)

    def _unpark(self, cid: str, drop: Callable[[bytes, PullRequest, float], bool]) -> list[Parked]:
        """Take the parked pulls of `cid` that `drop(peer, pull, until)` picks out of its queue."""
        taken, kept = [], []
        for parked in self._parked.pop(cid):
            (taken if drop(*parked) else kept).append(parked)
        if kept:
            self._parked[cid] = kept
        return taken

    def peer_gone(self, io: SocketIO, peer: bytes) -> None:
        for cid in list(self._parked):
            self._unpark(cid, lambda p, _req, _until: p == peer)
        for cid, off in list(self._offers.items()):
            if any(job.peer == peer for job in off.jobs.values()):
                self._end(io, cid, "peer_gone", "the receiver disconnected", skip=peer)

    def _refuse(self, io: SocketIO, peer: bytes, req: PullRequest, problem: tuple[str, str]) -> None:
        self._stats.count_failure(problem[0])
        self._send(io, peer, Failed(reason=problem[0], detail=problem[1], pull_id=req.pull_id), [])

    def _pull_problem(self, peer: bytes, req: PullRequest, off: Offered | None) -> tuple[str, str] | None:
        if req.ctx_epoch != self._epoch:
            return "epoch_mismatch", (
                f"context server restarted: the request was prefilled by epoch {req.ctx_epoch}, "
                f"this is epoch {self._epoch}"
            )
        if off is None:
            return "unknown_request", (
                f"no lease for ctx_request_id {req.ctx_request_id!r} (unknown, expired or released)")
        # one pull at a time, or one part per receiver (replicated kv heads: several ranks want the same)
        if any(not (job.keep_lease and req.keep_lease) or job.peer == peer for job in off.jobs.values()):
            return "bad_request", f"a pull for {req.ctx_request_id!r} is already running"
        if req.via_ipc and not self._ipc_offered():
            return "bad_request", "the pull asks for CUDA IPC, which this context server never offered"
        if req.via_ipc and req.heads is not None:
            return "bad_request", "the pull asks for some kv heads over CUDA IPC (whole slots only)"
        problem = off.range_problem(req.ranges)
        if problem is None and req.heads is not None:
            held = min(w.pool.shape[4] for w in off.offer.windows.values())
            if not 0 <= req.heads[0] < req.heads[1] <= held:
                problem = f"kv heads [{req.heads[0]}, {req.heads[1]}) are not among this rank's {held}"
        return None if problem is None else ("bad_request", problem)

    def pump(self, io: SocketIO) -> float | None:
        """Send chunks and finished same-GPU pulls; seconds until the next call (None: idle)."""
        self._send_ipc_ready(io)
        again = self._pump_bytes(io)
        if self._ipc:
            again = POLL_S if again is None else min(again, POLL_S)
        return again

    def _pump_bytes(self, io: SocketIO) -> float | None:
        budget = CHUNKS_PER_PUMP
        while self._active and budget > 0 and self._room():
            if wait := self._pacer.wait_s():  # test only: the modelled link is busy
                return wait
            cid, pull_id = self._active[0]
            off = self._offers[cid]
            job = off.jobs[pull_id]
            budget -= 1
            try:
                if not self._next(io, off, job):
                    return ROOM_POLL_S  # every staging buffer is still with zmq
            except Exception as e:
                self._broken(io, cid, job.pull_id, e)
        if not self._active:
            return None
        return 0.0 if self._room() else ROOM_POLL_S

    def _next(self, io: SocketIO, off: Offered, job: Job) -> bool:
        """Send the next chunk, or Done after the last (a streamed pull that caught up leaves the queue
        until the next `Extend`); False when no staging buffer is free."""
        if not job.chunks:
            self._active.popleft()
            job.queued = False
            if complete(off, job):
                self._send(io, job.peer, self._done(off, job), [])
                job.done_sent = True
            return True
        if not self._send_chunk(io, off, job, job.chunks[0]):
            return False
        job.chunks.popleft()
        return True

    def _room(self) -> bool:
        self._inflight = [t for t in self._inflight if not t.done]
        return len(self._inflight) < MAX_INFLIGHT

    def _send_chunk(self, io: SocketIO, off: Offered, job: Job, plan: WindowRange) -> bool:
        """Send one chunk; False (nothing done) when no staging buffer is free."""
        slots = off.range_slots(plan)  # primary slots: where the bytes are
        pool, max_frame = off.offer.windows[plan.window].pool, self._config.max_chunk_bytes
        unit = self._unit_bytes(off, plan.window, job)
        nbytes = plan.count * unit
        if job.heads is None and pool.device.type == "cpu" and unit >= ZERO_COPY_SLOT_BYTES:
            parts = [v[s:e] for v in pool_views(pool, slots) for s, e in frame_bounds(v.size, max_frame)]
            frames, tracker = tracked_frames(parts)
            off.pool_frames.append(tracker)
        else:
            if self._staging is None:
                self._staging = StagingPool(self._config.max_chunk_bytes, STAGING_BUFFERS, pin=pool.is_cuda)
            staging = self._staging
            i = staging.acquire()
            if i is None:
                return False
            with self._reading(off, pool.device):
                if job.heads is None:
                    gather(pool, slots, staging.buffer(i))
                else:
                    gather_heads(pool, slots, job.heads, staging.buffer(i))
            bounds = frame_bounds(nbytes, max_frame)
            parts = staging.parts(i, bounds)
            frames, tracker = staging.frames(i, bounds)
        digest = checksum(parts, unit, plan.first)
        header = ChunkHeader(pull_id=job.pull_id, window=plan.window, first=plan.first, count=plan.count,
                             nbytes=nbytes, checksum=digest)
        self._send(io, job.peer, header, frames)
        self._pacer.sent(nbytes)
        self._inflight.append(tracker)
        job.sent_bytes += nbytes
        job.sent_chunks += 1
        self._stats.bytes_sent += nbytes
        return True

    def _serve_ipc(self, io: SocketIO, cid: str, off: Offered, job: Job, ranges: list[WindowRange],
                   last: bool) -> None:
        """Same-GPU pull (a batch per `Extend` when streamed): queue the checksums on the device; slots,
        checksums and, after the `last` batch, Done go once it finished (`_send_ipc_ready`)."""
        parts = []
        for part in (p for r in ranges for p in r.split(MAX_IPC_SLOTS)):
            pool, slots = off.offer.windows[part.window].pool, off.range_slots(part)
            with self._reading(off, pool.device, wait=False):
                parts.append(IpcPart(part, slots, start_checksum(pool, slots, part.first)))
        self._ipc.add(cid, job.pull_id, parts, last)
        self._send_ipc_ready(io)  # CPU pools: summed already

    def _send_ipc_ready(self, io: SocketIO) -> None:
        for cid, pull_id, parts, last in self._ipc.ready():
            off = self._offers.get(cid)  # a lease that ended left `_ipc` (`_end`)
            if off is None:
                continue
            job = off.jobs[pull_id]
            try:
                chunks = [part.chunk(job.pull_id) for part in parts]
            except Exception as e:
                self._broken(io, cid, job.pull_id, e)
                continue
            for chunk in chunks:
                self._send(io, job.peer, chunk, [])
            nbytes = sum(len(p.slots) * off.offer.windows[p.range.window].slot_bytes for p in parts)
            job.sent_bytes += nbytes
            job.sent_chunks += len(chunks)
            self._stats.bytes_sent += nbytes  # counted before the Done leaves
            if last:
                job.done_sent = True
                self._stats.ipc_transfers += 1
                self._send(io, job.peer, self._done(off, job), [])

    @staticmethod
    def _done(off: Offered, job: Job) -> Done:
        return Done(pull_id=job.pull_id, total_bytes=job.sent_bytes, chunks=job.sent_chunks,
                    first_tokens=list(off.first_tokens), cached_tokens=off.cached_tokens)

    @contextmanager
    def _reading(self, off: Offered, device: torch.device, wait: bool = True) -> Iterator[None]:
        """Read the lease's slots under the pool lock (CUDA: a side stream after its writes; `wait`: done on exit)."""
        with self._pool_lock:
            if device.type != "cuda":
                yield
                return
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                if off.ready is not None:
                    stream.wait_event(off.ready)
                yield
            if wait:
                stream.synchronize()

    def _broken(self, io: SocketIO, cid: str, pull_id: int, e: Exception) -> None:
        """A broken invariant fails the pull (its lease ends), never the socket thread."""
        log.exception("KV sender: pull %d of %r failed", pull_id, cid)
        self._end(io, cid, "internal_error", f"the context server failed to serve the pull: {e}")

    def _end(self, io: SocketIO, cid: str, reason: str | None, detail: str, skip: bytes | None = None) -> None:
        """End a lease (once; the engine always gets it back in `Ended`): its running pulls fail with
        `reason`, each receiver told unless it is `skip` (the peer that cancelled, or is gone)."""
        off = self._offers.pop(cid)
        if not off.offer.final:
            self._dropped[cid] = (time.monotonic() + self._config.timeout_s, "unknown_request",
                                  f"the streamed lease {cid!r} has ended")
        self._active = deque(a for a in self._active if a[0] != cid)
        self._ipc.drop(cid)
        self._stats.lease_expired += reason == "lease_expired"
        self._stats.streamed += reason is None and not off.offer.final
        for job in off.jobs.values() if reason is not None else ():
            self._stats.count_failure(reason)
            if job.peer == skip:
                continue
            try:
                self._send(io, job.peer, Failed(reason=reason, detail=detail, pull_id=job.pull_id), [])
            except Exception:  # the receiver then times out; the lease still comes back
                log.exception("KV sender: could not tell pull %d of %r that it failed", job.pull_id, cid)
        io.deliver(Ended(cid, [t for t in off.pool_frames if not t.done]))

