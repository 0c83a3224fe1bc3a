"""Generation side: pulls the blocks a request lacks from the context server (`KVReceiver`).

Threads: the engine thread calls every public method and does all tensor work (checksum and
scatter into its own primary slots); the socket thread (`link.ReceiverLink`) owns one
DEALER per context endpoint. The caller owns the destination blocks: they must stay allocated
(in use, so their slots do not move) until the pull's `PullResult` arrives or `cancel` is called,
and the caller frees them when the result says it failed.

No late writer: the only writes into our slots happen in `step`, on the engine thread, for pulls
still registered here. `cancel` (and every failure) unregisters the pull at once, before the caller
frees its blocks, so chunks of it that are still on the wire are dropped unwritten (`late_chunks`)
and a slot handed to another request is never written by the old transfer.

Same GPU as the sender (CUDA IPC, `ipc.py`): the socket thread opens the sender's pools once per
(endpoint, epoch) and hands them over (`IpcPools`); the pull's chunks then come as `IpcChunk`s
(the sender's slots, no payload), and `step` queues their copy into our slots on a side stream
(`ipc_copies.py`: one pass that copies and sums) and checks the checksum of what it wrote in a later
`step`, once the device has finished it; the engine thread never waits for the copy. `Done` and the
Ack are the byte path's; a pull whose copies are still running finishes when they are checked.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from kvcache import KVCacheManager, Level
from transceiver.config import TransceiverConfig
from transceiver.ipc import ipc_identity, open_pools
from transceiver.link import SocketThread
from transceiver.payload import checksum, parts_are_valid, scatter
from transceiver.receiver.ipc_copies import Copy, IpcCopies
from transceiver.receiver.link import IpcPools, PeerDown, Probe, Pull, PullRefused, Received, ReceiverLink, Send
from transceiver.receiver.pull import PullResult, PullState, check_wanted
from transceiver.stats import TransferStats
from transceiver.wire import (
    REASONS,
    Ack,
    Cancel,
    ChunkHeader,
    Done,
    Failed,
    IpcChunk,
    IpcOffer,
    PullRequest,
    WindowRange,
    layout_of,
)

log = logging.getLogger(__name__)


class KVReceiver:
    """Pulls KV blocks from context servers into this server's primary pool."""

    def __init__(self, kv: KVCacheManager, config: TransceiverConfig, fingerprint: str,
                 on_message: Callable[[], None] | None = None) -> None:
        """`on_message()` is called (from the socket thread) whenever messages await `step`."""
        self._kv = kv
        self._config = config
        self.epoch = uuid.uuid4().hex
        self.stats = TransferStats()
        self._pulls: dict[int, PullState] = {}  # by pull_id
        self._by_request: dict[str, int] = {}  # request_id -> pull_id
        self._results: list[PullResult] = []
        # endpoint -> (sender epoch, window -> the sender's primary pool opened through CUDA IPC)
        self._ipc_pools: dict[str, tuple[str, dict[int, torch.Tensor]]] = {}
        self._copies = IpcCopies(on_message)  # same-GPU copies on the device
        pools = {w: kv.pool(w, Level.PRIMARY) for w in kv.window_sizes}
        identity = ipc_identity(pools, config.same_host_ipc)

        def open_ipc(offer: IpcOffer) -> dict[int, torch.Tensor]:  # runs on the socket thread
            return open_pools(offer, pools)

        link = ReceiverLink(config, self.epoch, layout_of(kv, pools, fingerprint), self.stats, identity, open_ipc)
        self._link = link
        self._thread = SocketThread("kv-receiver", link, inbox_size=16, notify=on_message)
        self._thread.start()

    # ---- engine thread API -------------------------------------------------------------------

    def start_pull(self, request_id: str, ctx_endpoint: str, ctx_epoch: str, ctx_request_id: str,
                   wanted: dict[int, tuple[int, list[int]]]) -> None:
        """Pull, per window, the blocks [first, first + len(slots)) of the context request into
        `slots` (primary slot indices of this server, in block order)."""
        if request_id in self._by_request:
            raise ValueError(f"request {request_id!r} is already pulling")
        check_wanted(self._kv, wanted)
        now = time.monotonic()
        pull = PullState(request_id, secrets.randbits(63), ctx_endpoint, ctx_epoch, ctx_request_id,
                     {w: (first, list(slots)) for w, (first, slots) in wanted.items()},
                     now, now + self._config.timeout_s)
        pull.next_first = {w: first for w, (first, _) in pull.wanted.items()}
        self._pulls[pull.pull_id] = pull
        self._by_request[request_id] = pull.pull_id
        ranges = [WindowRange(window=w, first=first, count=len(slots))
                  for w, (first, slots) in sorted(pull.wanted.items()) if slots]
        req = PullRequest(pull_id=pull.pull_id, ctx_request_id=ctx_request_id, ctx_epoch=ctx_epoch,
                          ranges=ranges)
        self._thread.submit(Pull(ctx_endpoint, req))

    def step(self) -> list[PullResult]:
        """Apply received chunks (checksum, scatter), finish or fail pulls; returns finished pulls."""
        for item in self._thread.drain():
            if isinstance(item, PullRefused):
                if item.pull_id in self._pulls:
                    self._fail(self._pulls[item.pull_id], item.reason, item.detail, notify=False)
            elif isinstance(item, IpcPools):
                self._ipc_pools.pop(item.endpoint, None)  # drops the old mapping
                if item.epoch is not None and item.pools is not None:
                    self._ipc_pools[item.endpoint] = (item.epoch, item.pools)
            elif isinstance(item, PeerDown):  # Cancel anyway: it reaches the peer if it comes back
                for pull in [p for p in self._pulls.values() if p.endpoint == item.endpoint]:
                    self._fail(pull, "peer_gone", item.detail)
            else:
                self._on_received(item)
        self._settle_copies()
        now = time.monotonic()
        for pull in [p for p in self._pulls.values() if p.deadline <= now]:
            self._fail(pull, "timeout", f"the KV transfer did not finish within "
                                        f"{self._config.kv_transfer_timeout_ms} ms")
        results, self._results = self._results, []
        return results

    def wait(self, timeout_s: float) -> None:
        """Block until a message arrives for `step` or `timeout_s` passes."""
        self._thread.wait(timeout_s)

    def cancel(self, request_id: str) -> bool:
        """Abandon a pull (client gone, request aborted): the context side drops its lease. False
        when `request_id` has no running pull."""
        pull_id = self._by_request.get(request_id)
        if pull_id is not None:
            self._fail(self._pulls[pull_id], "cancelled", "cancelled by the generation server", report=False)
        return pull_id is not None

    def release_remote(self, ctx_endpoint: str, ctx_request_id: str, ctx_epoch: str | None = None) -> None:
        """Tell a context server to drop a lease without pulling (early reject, nothing missing)."""
        self._thread.submit(Send(ctx_endpoint, Cancel(ctx_request_id=ctx_request_id, ctx_epoch=ctx_epoch)))

    @property
    def num_pulls(self) -> int:
        return len(self._pulls)

    # ---- any thread (the HTTP layer's health) -------------------------------------------------

    def probe(self, ctx_endpoint: str) -> None:
        """Shake hands with a context server now, before any pull needs it (layout check)."""
        self._thread.submit(Probe(ctx_endpoint), timeout_s=0)  # best effort: never hold the event loop

    def peer_status(self) -> dict[str, str]:
        """endpoint -> "compatible", "unchecked", "unreachable" or "incompatible: <what differs>"."""
        return dict(self._link.peer_status)

    @property
    def link_alive(self) -> bool:
        """False once the socket thread has died: no pull can run (the server reports it)."""
        return self._thread.running

    @property
    def link_name(self) -> str:
        return self._thread.name

    def close(self) -> None:
        """Cancel every running pull (results are dropped) and stop the socket thread."""
        pulls = list(self._pulls.values())
        for pull in pulls:
            self._fail(pull, "cancelled", "the generation server is shutting down", report=False)
        if pulls:
            time.sleep(0.05)  # let the Cancel notices leave before the sockets close (linger 0)
        self._thread.close()
        self._copies.close()
        self._ipc_pools.clear()

    # ---- messages ----------------------------------------------------------------------------

    def _on_received(self, item: Received) -> None:
        body = item.body
        pull = self._pulls.get(body.pull_id) if body.pull_id is not None else None
        if pull is None or pull.endpoint != item.endpoint:  # a pull that ended: never written (no late writer)
            self.stats.late_chunks += isinstance(body, ChunkHeader | IpcChunk)
            return
        if pull.first_at is None:
            pull.first_at = item.at
        if item.sender_epoch != pull.ctx_epoch:
            self._fail(pull, "epoch_mismatch", f"context server restarted (epoch {item.sender_epoch}, "
                                               f"the request was prefilled by epoch {pull.ctx_epoch})")
        elif isinstance(body, ChunkHeader | IpcChunk):
            start = time.monotonic()
            if isinstance(body, IpcChunk):
                self._on_ipc_chunk(pull, body)
            else:
                problem = self._apply_chunk(pull, body, item.payload)
                if problem is not None:
                    self._fail(pull, "integrity", problem)
            pull.apply_s += time.monotonic() - start
        elif isinstance(body, Done):
            if self._copies.pending(pull.pull_id):
                pull.done = body  # finished once its copies are checked (`_settle_copies`)
            else:
                self._finish(pull, body)
        elif isinstance(body, Failed):
            reason = body.reason if body.reason in REASONS else "remote_error"
            self._fail(pull, reason, f"context server: {body.detail}", notify=False)

    def _apply_chunk(self, pull: PullState, h: ChunkHeader, frames: list) -> str | None:
        """Check a chunk against the pull and its checksum, then write it; a problem -> sentence."""
        if h.window not in pull.wanted or h.first != pull.next_first[h.window]:
            return f"unexpected chunk: window {h.window}, block {h.first}"
        first, slots = pull.wanted[h.window]
        slot_bytes = self._kv.slot_bytes(h.window)
        parts = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]  # zero-copy views
        got = sum(p.size for p in parts)
        if h.count < 1 or h.first + h.count > first + len(slots) or h.nbytes != h.count * slot_bytes:
            return f"chunk header does not fit the pull: window {h.window}, blocks {h.first}+{h.count}"
        if not parts_are_valid(parts, h.count, slot_bytes):
            return f"chunk byte count mismatch: header says {h.nbytes}, received {got} in {len(parts)} frames"
        if checksum(parts, slot_bytes, h.first) != h.checksum:
            return f"chunk checksum mismatch (window {h.window}, blocks {h.first}..{h.first + h.count - 1})"
        dst = slots[h.first - first : h.first - first + h.count]
        scatter(self._kv.pool(h.window, Level.PRIMARY), dst, parts)
        pull.next_first[h.window] = h.first + h.count
        pull.nbytes += h.nbytes
        pull.chunks += 1
        self.stats.bytes_received += h.nbytes
        return None

    def _on_ipc_chunk(self, pull: PullState, h: IpcChunk) -> None:
        try:
            problem = self._apply_ipc_chunk(pull, h)
        except Exception as e:  # a CUDA error must fail this pull, not the engine loop
            log.exception("KV receiver: CUDA IPC copy of pull %d failed", pull.pull_id)
            self._fail(pull, "internal_error", f"the generation server failed to copy the blocks: {e}")
            return
        if problem is not None:
            self._fail(pull, "integrity", problem)

    def _apply_ipc_chunk(self, pull: PullState, h: IpcChunk) -> str | None:
        """Queue the copy of the sender's slots `h.slots` into ours (same GPU); checked once done."""
        opened = self._ipc_pools.get(pull.endpoint)
        if opened is None or opened[0] != pull.ctx_epoch:
            return f"CUDA IPC chunk but no pools of {pull.endpoint} epoch {pull.ctx_epoch} are open"
        if h.window not in pull.wanted or h.first != pull.next_first[h.window]:
            return f"unexpected chunk: window {h.window}, block {h.first}"
        first, slots = pull.wanted[h.window]
        src = opened[1][h.window]  # [sender's num_slots, layers, 2, tpb, heads, dim]
        count = len(h.slots)
        if count < 1 or h.first + count > first + len(slots) or any(not 0 <= s < src.shape[0] for s in h.slots):
            return f"CUDA IPC chunk does not fit the pull: window {h.window}, blocks {h.first}+{count}"
        dst = slots[h.first - first : h.first - first + count]
        self._copies.start(pull.pull_id, h, src, self._kv.pool(h.window, Level.PRIMARY), dst,
                           count * self._kv.slot_bytes(h.window))
        pull.next_first[h.window] = h.first + count
        return None

    def _settle_copies(self) -> None:
        """Check the copies the device has finished; finish pulls whose Done waited for them."""
        for copy in self._copies.settled():
            pull = self._pulls.get(copy.pull_id)
            if pull is not None:
                self._check_copy(pull, copy)
        for pull in [p for p in self._pulls.values() if p.done is not None]:
            if not self._copies.pending(pull.pull_id):
                self._finish(pull, pull.done)

    def _check_copy(self, pull: PullState, copy: Copy) -> None:
        h = copy.chunk
        pull.apply_s += time.monotonic() - copy.issued
        if copy.checksum.value() != h.checksum:
            self._fail(pull, "integrity", f"chunk checksum mismatch after the CUDA IPC copy (window {h.window}, "
                                          f"blocks {h.first}..{h.first + len(h.slots) - 1})")
            return
        pull.nbytes += copy.nbytes
        pull.chunks += 1
        pull.via_ipc = True
        self.stats.bytes_received += copy.nbytes

    def _finish(self, pull: PullState, done: Done) -> None:
        missing = [w for w, (first, slots) in pull.wanted.items() if pull.next_first[w] != first + len(slots)]
        if missing or done.total_bytes != pull.nbytes or done.chunks != pull.chunks:
            self._fail(pull, "integrity", (
                f"transfer incomplete: windows {missing} short, {pull.nbytes}/{done.total_bytes} bytes, "
                f"{pull.chunks}/{done.chunks} chunks"))
            return
        self._succeed(pull)

    def _succeed(self, pull: PullState) -> None:
        """Every wanted block is written: Ack (the sender drops the lease) and report."""
        ack = Ack(pull_id=pull.pull_id, ctx_request_id=pull.ctx_request_id)
        self._thread.submit(Send(pull.endpoint, ack))
        self._forget(pull)
        seconds = time.monotonic() - pull.started
        wait = (pull.first_at or pull.started) - pull.started
        self.stats.add_phases(wait=wait, apply=pull.apply_s, rest=max(0.0, seconds - wait - pull.apply_s))
        self.stats.count_ok(seconds, pull.nbytes)
        self.stats.ipc_transfers += pull.via_ipc
        self._results.append(PullResult(pull.request_id, True, nbytes=pull.nbytes, seconds=seconds))

    # ---- failure -------------------------------------------------------------------------------

    def _fail(self, pull: PullState, reason: str, detail: str, notify: bool = True, report: bool = True) -> None:
        """End a pull that did not succeed; `notify` tells the context side to drop its lease."""
        self._forget(pull)
        self.stats.count_failure(reason)
        if notify:
            cancel = Cancel(ctx_request_id=pull.ctx_request_id, pull_id=pull.pull_id,
                            ctx_epoch=pull.ctx_epoch)
            self._thread.submit(Send(pull.endpoint, cancel))
        if report:
            self._results.append(PullResult(pull.request_id, False, reason, detail, pull.nbytes,
                                            time.monotonic() - pull.started))

    def _forget(self, pull: PullState) -> None:
        self._copies.abandon(pull.pull_id)  # no late writer: before the caller frees the blocks
        del self._pulls[pull.pull_id]
        del self._by_request[pull.request_id]
