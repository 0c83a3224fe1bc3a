"""Generation side: pulls the blocks a request lacks from the context server (`KVReceiver`).

The engine thread calls every public method and does all tensor work (socket thread:
`link.ReceiverLink`). The caller keeps the destination blocks until the `PullResult` (or `cancel`).
No late writer: slots are written only in `step`, for pulls still registered; `cancel` and failures
unregister at once, so chunks still on the wire are dropped (`late_chunks`).

Same GPU: `IpcChunk`s are copied on a side stream and checked in a later `step` (`ipc_copies.py`);
a `Done` that comes first waits for them. Streamed pulls: each chunk renews the deadline; the `Done`
brings the first token. Tensor parallelism (tp.py): one part per context rank (`Planned`); a failed
part fails the request and cancels the others; with several ranks the lease ends with a `Release`.
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
from transceiver.link import LinkOwner, SocketThread
from transceiver.payload import checksum, parts_are_valid, scatter
from transceiver.receiver.ipc_copies import IpcCopies
from transceiver.receiver.items import IpcPools, PeerDown, Planned, Probe, Pull, PullRefused, Received, Send
from transceiver.receiver.link import ReceiverLink
from transceiver.receiver.pull import Part, Pulling, PullResult, Wanted, check_wanted
from transceiver.stats import TransferStats
from transceiver.tp import scatter_heads, unit_bytes
from transceiver.wire import (
    REASONS,
    Ack,
    Cancel,
    ChunkHeader,
    Done,
    Failed,
    IpcChunk,
    PullRequest,
    Release,
    WindowRange,
    layout_of,
)

log = logging.getLogger(__name__)


class KVReceiver(LinkOwner):

    def __init__(self, kv: KVCacheManager, config: TransceiverConfig, fingerprint: str,
                 on_message: Callable[[], None] | None = None, *, kv_heads: tuple[int, int] | None = None,
                 releases: bool = True) -> None:
        """`on_message()` (socket thread): messages await `step`. `kv_heads`: a tensor-parallel rank's
        (first, the model's); `releases=False`: one rank's share (neither ends the lease nor counts)."""
        self._kv = kv
        self._config = config
        self._releases = releases
        self.epoch = uuid.uuid4().hex
        self.stats = TransferStats()
        self._pulling: dict[str, Pulling] = {}  # by request_id
        self._unplanned: dict[int, Pulling] = {}  # by pull_id, until the socket thread planned them
        self._parts: dict[int, Part] = {}  # running parts by pull_id
        self._results: list[PullResult] = []
        # endpoint -> (sender epoch, window -> the sender's primary pool opened through CUDA IPC)
        self._ipc_pools: dict[str, tuple[str, dict[int, torch.Tensor]]] = {}
        self._copies = IpcCopies(on_message)  # same-GPU copies on the device
        pools = {w: kv.pool(w, Level.PRIMARY) for w in kv.window_sizes}
        layout = layout_of(kv, pools, fingerprint, kv_heads)
        self._link = ReceiverLink(config, self.epoch, layout, self.stats, ipc_identity(pools, config.same_host_ipc),
                                  lambda offer: open_pools(offer, pools))  # opened on the socket thread
        self._thread = SocketThread("kv-receiver", self._link, inbox_size=16, notify=on_message)
        self._thread.start()

    # ---- engine thread API -------------------------------------------------------------------

    def start_pull(self, request_id: str, ctx_endpoint: str, ctx_epoch: str, ctx_request_id: str,
                   wanted: Wanted, stream: bool = False) -> None:
        """Pull, per window, blocks [first, first + len(slots)) of the context request into our primary
        `slots`; `stream`: while it is prefilled (the result then carries the first token)."""
        if request_id in self._pulling:
            raise ValueError(f"request {request_id!r} is already pulling")
        check_wanted(self._kv, wanted)
        now = time.monotonic()
        pulling = Pulling(request_id, secrets.randbits(63), ctx_endpoint, ctx_epoch, ctx_request_id,
                          {w: (first, list(slots)) for w, (first, slots) in wanted.items()},
                          now, now + self._config.timeout_s, stream=stream)
        self._pulling[request_id] = self._unplanned[pulling.pull_id] = pulling
        ranges = [WindowRange(window=w, first=first, count=len(slots))
                  for w, (first, slots) in sorted(pulling.wanted.items()) if slots]
        req = PullRequest(pull_id=pulling.pull_id, ctx_request_id=ctx_request_id, ctx_epoch=ctx_epoch,
                          ranges=ranges, stream=stream)
        self._thread.submit(Pull(ctx_endpoint, req))

    def step(self) -> list[PullResult]:
        """Apply received chunks (checksum, scatter), finish or fail pulls; returns finished pulls."""
        for item in self._thread.drain():
            self._on_item(item)
        self._settle_copies()
        now = time.monotonic()
        for pulling in [p for p in self._pulling.values() if p.deadline <= now]:
            self._fail(pulling, "timeout", f"the KV transfer did not finish within "
                                           f"{self._config.kv_transfer_timeout_ms} ms")
        results, self._results = self._results, []
        return results

    def wait(self, timeout_s: float) -> None:
        self._thread.wait(timeout_s)

    def cancel(self, request_id: str) -> bool:
        """Abandon a pull (the context side drops its lease); False when none is running."""
        pulling = self._pulling.get(request_id)
        if pulling is not None:
            self._fail(pulling, "cancelled", "cancelled by the generation server", report=False)
        return pulling is not None

    def release_remote(self, ctx_endpoint: str, ctx_request_id: str, ctx_epoch: str | None = None,
                       pull_id: int | None = None) -> None:
        """Tell a context server to drop a lease (early reject, nothing missing; or the pull failed)."""
        cancel = Cancel(ctx_request_id=ctx_request_id, pull_id=pull_id, ctx_epoch=ctx_epoch)
        self._thread.submit(Send(ctx_endpoint, cancel))

    def release_lease(self, ctx_endpoint: str, ctx_request_id: str, ctx_epoch: str) -> None:
        """Every rank's share of a lease's KV arrived: its context server ends the lease (a success)."""
        self._thread.submit(Send(ctx_endpoint, Release(ctx_request_id=ctx_request_id, ctx_epoch=ctx_epoch)))

    @property
    def num_pulls(self) -> int:
        return len(self._pulling)

    # ---- any thread (the HTTP layer's health) -------------------------------------------------

    def probe(self, ctx_endpoint: str) -> None:
        """Shake hands with a context server now, before any pull needs it (layout check)."""
        self._thread.submit(Probe(ctx_endpoint), timeout_s=0)  # best effort: never hold the event loop

    def peer_status(self) -> dict[str, str]:
        """endpoint -> "compatible", "unchecked", "unreachable" or "incompatible: <what differs>"."""
        return dict(self._link.peer_status)

    def close(self) -> None:
        """Cancel every running pull (results are dropped) and stop the socket thread."""
        pulls = list(self._pulling.values())
        for pulling in pulls:
            self._fail(pulling, "cancelled", "the generation server is shutting down", report=False)
        if pulls:
            time.sleep(0.05)  # let the Cancel notices leave before the sockets close (linger 0)
        self._thread.close()
        self._copies.close()
        self._ipc_pools.clear()

    def _on_item(self, item) -> None:
        if isinstance(item, Planned):
            self._on_planned(item)
        elif isinstance(item, PullRefused):
            part = self._parts.get(item.pull_id)
            pulling = self._unplanned.get(item.pull_id) or (part.pulling if part is not None else None)
            if pulling is not None:
                self._fail(pulling, item.reason, item.detail, notify=False)
        elif isinstance(item, IpcPools):
            self._ipc_pools.pop(item.endpoint, None)  # drops the old mapping
            if item.epoch is not None and item.pools is not None:
                self._ipc_pools[item.endpoint] = (item.epoch, item.pools)
        elif isinstance(item, PeerDown):  # Cancel anyway: it reaches the peer if it comes back
            down = {part.pulling.request_id: part.pulling for part in self._parts.values()
                    if part.endpoint == item.endpoint}
            for pulling in down.values():
                self._fail(pulling, "peer_gone", item.detail)
        else:
            self._on_received(item)

    def _part(self, pull_id: int, endpoint: str) -> Part | None:
        """The running part `pull_id`; a pull sent as it is (no `Planned`) becomes its own single part
        at the first answer from its endpoint."""
        pulling = self._unplanned.get(pull_id)
        if pulling is not None and pulling.endpoint == endpoint:
            del self._unplanned[pull_id]
            pulling.parts[pull_id] = self._parts[pull_id] = Part(pulling, pull_id, endpoint, None)
        return self._parts.get(pull_id)

    def _on_planned(self, plan: Planned) -> None:
        pulling = self._unplanned.pop(plan.pull_id, None)
        if pulling is None:  # cancelled or failed meanwhile: its parts that went out must stop too
            for pull_id, p in plan.parts:
                self.release_remote(p.endpoint, plan.ctx_request_id, plan.ctx_epoch, pull_id)
            return
        pulling.several = True
        for pull_id, p in plan.parts:
            pulling.parts[pull_id] = self._parts[pull_id] = Part(pulling, pull_id, p.endpoint, p.dst)

    def _on_received(self, item: Received) -> None:
        body = item.body
        part = self._part(body.pull_id, item.endpoint) if body.pull_id is not None else None
        if part is None or part.endpoint != item.endpoint:  # a pull that ended: never written (no late writer)
            self.stats.late_chunks += isinstance(body, ChunkHeader | IpcChunk)
            return
        if part.first_at is None:
            part.first_at = item.at
        pulling = part.pulling
        if item.sender_epoch != pulling.ctx_epoch:
            self._fail(pulling, "epoch_mismatch", f"context server restarted (epoch {item.sender_epoch}, "
                                                  f"the request was prefilled by epoch {pulling.ctx_epoch})")
        elif isinstance(body, ChunkHeader | IpcChunk):
            start = time.monotonic()
            if pulling.stream:  # the prefill is making progress
                pulling.deadline = start + self._config.timeout_s
            problem = self._apply(part, body, item.payload)
            part.apply_s += time.monotonic() - start
            if problem is not None:
                self._fail(pulling, *problem)
        elif isinstance(body, Done):
            if self._copies.pending(part.pull_id):
                part.done = body  # finished once its copies are checked (`_settle_copies`)
            else:
                self._finish(part, body)
        elif isinstance(body, Failed):
            reason = body.reason if body.reason in REASONS else "remote_error"
            self._fail(pulling, reason, f"context server: {body.detail}", notify=False, failed_part=part)

    def _apply(self, part: Part, body: ChunkHeader | IpcChunk, payload: list) -> tuple[str, str] | None:
        """Check one chunk of `part` and write it (CUDA IPC: queue its copy); a problem -> (reason, sentence)."""
        window, wanted = body.window, part.pulling.wanted
        if window not in wanted or body.first != part.next_first[window]:
            return "integrity", f"unexpected chunk: window {window}, block {body.first}"
        first, slots = wanted[window]
        count = body.count if isinstance(body, ChunkHeader) else len(body.slots)
        dst = slots[body.first - first : body.first - first + count]  # shorter than count: beyond the pull
        pool, slot_bytes = self._kv.pool(window, Level.PRIMARY), self._kv.slot_bytes(window)
        if isinstance(body, ChunkHeader):
            unit = unit_bytes(slot_bytes, pool.shape[4], part.dst)
            parts = [np.frombuffer(f.buffer, dtype=np.uint8) for f in payload]  # zero-copy views
            if count < 1 or len(dst) < count or body.nbytes != count * unit:
                return "integrity", f"chunk header does not fit the pull: window {window}, blocks {body.first}+{count}"
            if not parts_are_valid(parts, count, unit):
                return "integrity", (f"chunk byte count mismatch: header says {body.nbytes}, received "
                                     f"{sum(p.size for p in parts)} in {len(parts)} frames")
            if checksum(parts, unit, body.first) != body.checksum:
                last = body.first + count - 1
                return "integrity", f"chunk checksum mismatch (window {window}, blocks {body.first}..{last})"
            if part.dst is None:
                scatter(pool, dst, parts)
            else:
                scatter_heads(pool, dst, part.dst, parts)
            self._written(part, body.nbytes)
            part.next_first[window] = body.first + count
            return None
        opened, epoch = self._ipc_pools.get(part.endpoint), part.pulling.ctx_epoch
        if opened is None or opened[0] != epoch:
            return "integrity", f"CUDA IPC chunk but no pools of {part.endpoint} epoch {epoch} are open"
        src = opened[1][window]  # [sender's num_slots, layers, 2, tpb, heads, dim]
        if count < 1 or len(dst) < count or any(not 0 <= s < src.shape[0] for s in body.slots):
            return "integrity", f"CUDA IPC chunk does not fit the pull: window {window}, blocks {body.first}+{count}"
        part.next_first[window] = body.first + count
        try:  # queued on a side stream; checked in a later step (`_settle_copies`)
            self._copies.start(part.pull_id, body, src, pool, dst, count * slot_bytes)
        except Exception as e:  # a CUDA error must fail this pull, not the engine loop
            log.exception("KV receiver: CUDA IPC copy of pull %d failed", part.pull_id)
            return "internal_error", f"the generation server failed to copy the blocks: {e}"
        return None

    def _written(self, part: Part, nbytes: int) -> None:
        part.nbytes += nbytes
        part.chunks += 1
        self.stats.bytes_received += nbytes

    def _settle_copies(self) -> None:
        """Check the copies the device has finished; finish parts whose Done waited for them."""
        for copy in self._copies.settled():
            part, h = self._parts.get(copy.pull_id), copy.chunk
            if part is None:
                continue
            part.apply_s += time.monotonic() - copy.issued
            if copy.checksum.value() != h.checksum:
                self._fail(part.pulling, "integrity", f"chunk checksum mismatch after the CUDA IPC copy (window "
                                                      f"{h.window}, blocks {h.first}..{h.first + len(h.slots) - 1})")
                continue
            self._written(part, copy.nbytes)
            part.via_ipc = True
        for part in [p for p in self._parts.values() if p.done is not None]:
            if part.pull_id in self._parts and not self._copies.pending(part.pull_id):
                self._finish(part, part.done)

    def _finish(self, part: Part, done: Done) -> None:
        missing = part.missing()
        if missing or done.total_bytes != part.nbytes or done.chunks != part.chunks:
            self._fail(part.pulling, "integrity", (
                f"transfer incomplete: windows {missing} short, {part.nbytes}/{done.total_bytes} bytes, "
                f"{part.chunks}/{done.chunks} chunks"))
            return
        if part.pulling.stream and not (done.first_tokens or part.pulling.first_tokens):
            self._fail(part.pulling, "integrity", "the streamed transfer ended without the first token")
            return
        if done.first_tokens:
            part.pulling.first_tokens, part.pulling.cached_tokens = tuple(done.first_tokens), done.cached_tokens
        self._thread.submit(Send(part.endpoint, Ack(pull_id=part.pull_id, ctx_request_id=part.pulling.ctx_request_id)))
        pulling = part.pulling
        del self._parts[part.pull_id], pulling.parts[part.pull_id]
        pulling.done_parts.append(part)
        if not pulling.parts:
            self._succeed(pulling)

    def _succeed(self, pulling: Pulling) -> None:
        """Every wanted block is written (every part Acked): release the lease and report."""
        if pulling.several and self._releases:
            self.release_lease(pulling.endpoint, pulling.ctx_request_id, pulling.ctx_epoch)
        del self._pulling[pulling.request_id]
        parts = pulling.done_parts
        seconds = time.monotonic() - pulling.started
        first_at = min((p.first_at for p in parts if p.first_at is not None), default=pulling.started)
        wait, apply = first_at - pulling.started, sum(p.apply_s for p in parts)
        self.stats.add_phases(wait=wait, apply=apply, rest=max(0.0, seconds - wait - apply))
        if self._releases:  # else the request's pull is counted where every rank's share comes together
            self.stats.count_ok(seconds, pulling.nbytes)
        self.stats.ipc_transfers += any(p.via_ipc for p in parts)
        self.stats.streamed += pulling.stream and self._releases
        self._results.append(PullResult(pulling.request_id, True, nbytes=pulling.nbytes, seconds=seconds,
                                        first_tokens=pulling.first_tokens, cached_tokens=pulling.cached_tokens))

    def _fail(self, pulling: Pulling, reason: str, detail: str, notify: bool = True, report: bool = True,
              failed_part: Part | None = None) -> None:
        """End a failed pull: a Cancel per part, except to the sender that reported the failure
        (`notify=False`: one that refused a duplicate must not lose the lease another pull reads)."""
        del self._pulling[pulling.request_id]
        self._unplanned.pop(pulling.pull_id, None)
        for pull_id in pulling.parts:
            self._copies.abandon(pull_id)  # no late writer: before the caller frees the blocks
            del self._parts[pull_id]
        self.stats.count_failure(reason)
        if pulling.several:
            targets = [(p.endpoint, p.pull_id) for p in [*pulling.parts.values(), *pulling.done_parts]
                       if notify or p is not failed_part]
        else:  # one rank on each side (or not planned yet)
            targets = [(pulling.endpoint, pulling.pull_id)] if notify else []
        for endpoint, pull_id in targets:
            self.release_remote(endpoint, pulling.ctx_request_id, pulling.ctx_epoch, pull_id)
        if report:
            self._results.append(PullResult(pulling.request_id, False, reason, detail, pulling.nbytes,
                                            time.monotonic() - pulling.started))
