"""Rank 0's KV sender and receiver of a tensor-parallel server: its own share, plus the other ranks'.

`RankedSender` offers a lease to the other ranks after the copies that onboarded it and tells them
when it ends, before any later forward or copy can write its slots. `RankedReceiver` starts a pull
on every rank; it ends when every share arrived (rank 0 then releases the lease) or one failed (the
others are cancelled). A latent KV cache is the same on every rank: rank 0 alone moves it, and a
generation server's rank 0 broadcasts what it pulled (`ShareLatent`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache import KVCacheManager
from server.models.parallel.plan import ShardPlan, kv_head_range
from server.tp.messages import CancelPull, EndLease, OfferLease, PullDone, ShareLatent, StartPull
from server.tp.ranks import Ranks
from server.tp.roles import held_kv_heads, share_latent
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver, PullResult
from transceiver.sender import KVSender
from transceiver.wire import RankEndpoint


class RankedSender(KVSender):
    def __init__(self, kv: KVCacheManager, config: TransceiverConfig, fingerprint: str,
                 on_message: Callable[[], None] | None, ranks: Ranks, plan: ShardPlan) -> None:
        others = [RankEndpoint(endpoint, kv_head_range(plan.num_kv_heads, plan.size, rank))
                  for rank, endpoint in enumerate(ranks.kv_endpoints) if rank > 0 and endpoint is not None]
        if kv.layout.format.latent:  # the same latent on every rank: rank 0 serves it alone
            others = []
        super().__init__(kv, config, fingerprint, on_message, epoch=ranks.epoch, kv_heads=held_kv_heads(plan, kv),
                         other_ranks=others)
        self.endpoints = [self.endpoint, *(o.endpoint for o in others)]
        self._ranks = ranks
        self._mirrored: set[str] = set()  # leases the other ranks serve

    def add_lease(self, ctx_request_id: str, blocks: dict[int, list[int]]) -> None:
        super().add_lease(ctx_request_id, blocks)
        slots = {w: self._slots(ids, w) for w, ids in blocks.items()}
        self._ranks.flush(OfferLease(ctx_request_id, slots))
        self._mirrored.add(ctx_request_id)

    def _slots(self, ids: list[int], window: int) -> list[int]:
        live = iter(self._kv.get_memory_pool_block_indices([b for b in ids if b >= 0], window))
        return [next(live) if b >= 0 else -1 for b in ids]

    def step(self) -> None:
        super().step()
        ended = self._mirrored - self.lease_ids
        if ended:
            self._ranks.flush(*(EndLease(cid) for cid in sorted(ended)))
            self._mirrored -= ended


@dataclass
class _Shares:
    """One request's pull on every rank."""

    ctx_endpoint: str
    ctx_epoch: str
    ctx_request_id: str
    started: float
    pending: set[int]  # ranks whose share has not arrived
    nbytes: int = 0
    stream: bool = False
    wanted: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # a latent cache's: what to share
    first_tokens: tuple[int, ...] = ()  # a streamed pull: from rank 0's share
    cached_tokens: int = 0


class RankedReceiver(KVReceiver):
    def __init__(self, kv: KVCacheManager, config: TransceiverConfig, fingerprint: str,
                 on_message: Callable[[], None] | None, ranks: Ranks, plan: ShardPlan) -> None:
        super().__init__(kv, config, fingerprint, on_message, kv_heads=held_kv_heads(plan, kv), releases=False)
        self._ranks = ranks
        self._shares: dict[str, _Shares] = {}
        self._latent = kv.layout.format.latent  # rank 0 pulls alone and shares it (module doc)

    def start_pull(self, request_id: str, ctx_endpoint: str, ctx_epoch: str, ctx_request_id: str,
                   wanted: dict[int, tuple[int, list[int]]], stream: bool = False) -> None:
        super().start_pull(request_id, ctx_endpoint, ctx_epoch, ctx_request_id, wanted, stream)
        if not self._latent:
            self._ranks.flush(StartPull(request_id, ctx_endpoint, ctx_epoch, ctx_request_id, wanted, stream))
        self._shares[request_id] = _Shares(ctx_endpoint, ctx_epoch, ctx_request_id, time.monotonic(),
                                           {0} if self._latent else set(range(self._ranks.size)), stream=stream,
                                           wanted=wanted if self._latent else {})

    def step(self) -> list[PullResult]:
        results = []
        for r in super().step():
            shares = self._shares.get(r.request_id)
            if shares is not None and r.first_tokens:  # a streamed pull: the first token came with rank 0's share
                shares.first_tokens, shares.cached_tokens = r.first_tokens, r.cached_tokens
            results += self._arrived(r.request_id, 0, r.ok, r.reason, r.error, r.nbytes)
        for d in (r for r in self._ranks.reports() if isinstance(r, PullDone)):
            results += self._arrived(d.request_id, d.rank, d.ok, d.reason, d.error, d.nbytes)
        return results

    def _arrived(self, request_id: str, rank: int, ok: bool, reason: str | None, error: str | None,
                 nbytes: int) -> list[PullResult]:
        shares = self._shares.get(request_id)
        if shares is None:  # ended already (another rank failed, or cancelled)
            return []
        seconds = time.monotonic() - shares.started
        if rank > 0:
            self.stats.bytes_received += nbytes  # rank 0's own bytes are counted as they land
        if not ok:
            del self._shares[request_id]
            self._end_others(request_id, shares, own=rank == 0 or super().cancel(request_id))
            if rank > 0:
                self.stats.count_failure(reason or "remote_error")
            return [PullResult(request_id, False, reason, f"rank {rank}: {error}", shares.nbytes + nbytes, seconds)]
        shares.pending.discard(rank)
        shares.nbytes += nbytes
        if shares.pending:
            return []
        del self._shares[request_id]
        if self._latent:  # one plain pull: its context server ended the lease; the other ranks take it
            self._ranks.flush(ShareLatent(shares.wanted))
            share_latent(self._kv, shares.wanted, 0)
        else:
            self.release_lease(shares.ctx_endpoint, shares.ctx_request_id, shares.ctx_epoch)
        self.stats.count_ok(seconds, shares.nbytes)
        self.stats.streamed += shares.stream
        return [PullResult(request_id, True, nbytes=shares.nbytes, seconds=seconds, first_tokens=shares.first_tokens,
                           cached_tokens=shares.cached_tokens)]

    def _end_others(self, request_id: str, shares: _Shares, own: bool) -> None:
        """A share failed or the pull was cancelled: stop the other ranks' (their receivers cancel their
        parts). `own`: rank 0's share failed, or was running and is cancelled; else if it had landed,
        the lease is cancelled here."""
        self._ranks.flush(CancelPull(request_id))
        if not own and 0 not in shares.pending:
            self.release_remote(shares.ctx_endpoint, shares.ctx_request_id, shares.ctx_epoch)

    def cancel(self, request_id: str) -> bool:
        shares = self._shares.pop(request_id, None)
        own = super().cancel(request_id)
        if shares is not None:
            self._end_others(request_id, shares, own)
        return own or shares is not None

    @property
    def num_pulls(self) -> int:
        return len(self._shares)
