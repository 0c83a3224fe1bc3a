"""A rank's part in its server's KV transfers: none (aggregated), a sender of its kv heads
(context), a receiver of them (generation), driven by rank 0's commands. A latent KV cache is the
same on every rank: rank 0 moves it and shares what it pulled (`share_latent`).
"""

from __future__ import annotations

import msgspec
import torch

from kvcache import KVCacheManager
from server.config.schema import ServerConfig
from server.models.parallel import group
from server.models.parallel.plan import ShardPlan
from server.tp.messages import CancelPull, EndLease, OfferLease, Op, PullDone, StartPull
from transceiver.receiver import KVReceiver
from transceiver.sender.rank_sender import RankSender


class NoTransfers:
    """An aggregated server's rank. Each role has `endpoint` (a context rank's KV sender address), `busy`
    (KV transfers in flight: poll often), `apply`, `step` and `close`."""

    endpoint = None
    busy = False

    def apply(self, op: Op) -> None:
        raise RuntimeError(f"an aggregated server's rank got {type(op).__name__}")

    def step(self) -> list[PullDone]:
        return []

    def close(self) -> None:
        return None


class LeaseShare:
    """A context server's rank: serves its kv heads of the leases rank 0 offers."""

    def __init__(self, sender: RankSender) -> None:
        self.sender = sender
        self.endpoint = sender.endpoint

    @property
    def busy(self) -> bool:
        return self.sender.busy

    def apply(self, op: Op) -> None:
        if isinstance(op, OfferLease):
            self.sender.offer(op.cid, op.slots)
        elif isinstance(op, EndLease):
            self.sender.end(op.cid)
        else:
            raise RuntimeError(f"a context server's rank got {type(op).__name__}")

    def step(self) -> list[PullDone]:
        self.sender.step()
        return []

    def close(self) -> None:
        self.sender.close()


class PullShare:
    """A generation server's rank: pulls its kv heads of the requests rank 0 pulls, reports each."""

    endpoint = None

    def __init__(self, receiver: KVReceiver, rank: int) -> None:
        self.receiver = receiver
        self.rank = rank

    @property
    def busy(self) -> bool:
        return self.receiver.num_pulls > 0

    def apply(self, op: Op) -> None:
        if isinstance(op, StartPull):
            self.receiver.start_pull(op.request_id, op.ctx_endpoint, op.ctx_epoch, op.ctx_request_id, op.wanted,
                                     stream=op.stream)
        elif isinstance(op, CancelPull):
            self.receiver.cancel(op.request_id)
        else:
            raise RuntimeError(f"a generation server's rank got {type(op).__name__}")

    def step(self) -> list[PullDone]:
        return [PullDone(self.rank, r.request_id, r.ok, r.reason, r.error, r.nbytes) for r in self.receiver.step()]

    def close(self) -> None:
        self.receiver.close()


def share_latent(kv: KVCacheManager, wanted: dict[int, tuple[int, list[int]]], rank: int) -> None:
    """Every rank calls it at the same point of its collectives: the rows of these primary slots,
    rank 0's, written into every other rank's pool."""
    for window in sorted(wanted):
        slots = [s for s in wanted[window][1] if s >= 0]
        if not slots:
            continue
        pool = kv.pool(window)
        idx = torch.tensor(slots, dtype=torch.int64, device=pool.device)
        rows = group.share_from_rank0(pool.index_select(0, idx))
        if rank:
            pool.index_copy_(0, idx, rows)


def held_kv_heads(plan: ShardPlan, kv: KVCacheManager) -> tuple[int, int]:
    """(first kv head this rank's pools hold, the model's kv heads), as the KV link names them. A
    latent cache (multi-head latent attention) is the same on every rank: one "head", held whole."""
    return (0, 1) if kv.layout.format.latent else (plan.kv_heads[0], plan.num_kv_heads)


def make_role(cfg: ServerConfig, kv: KVCacheManager, fingerprint: str, epoch: str, rank: int,
              plan: ShardPlan) -> NoTransfers | LeaseShare | PullShare:
    heads = held_kv_heads(plan, kv)
    if cfg.role == "context":  # a fixed KV port is rank 0's; rank r listens on port + r
        transceiver = cfg.cache_transceiver_config
        if transceiver.port:
            transceiver = msgspec.structs.replace(transceiver, port=transceiver.port + rank)
        return LeaseShare(RankSender(kv, transceiver, fingerprint, epoch, heads))
    if cfg.role == "generation":
        return PullShare(KVReceiver(kv, cfg.cache_transceiver_config, fingerprint, kv_heads=heads, releases=False),
                         rank)
    return NoTransfers()
