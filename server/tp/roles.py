"""A rank's part in its server's KV transfers: none (aggregated), a sender of its kv heads
(context), a receiver of them (generation). Rank 0 drives them through its commands."""

from __future__ import annotations

from typing import Protocol

from kvcache import KVCacheManager
from server.config.schema import ServerConfig
from server.models.parallel.plan import ShardPlan
from server.tp.messages import Op, PullDone


class WorkerRole(Protocol):
    endpoint: str | None  # a context rank's KV sender address

    @property
    def busy(self) -> bool:
        """KV transfers in flight: poll often."""

    def apply(self, op: Op) -> None: ...

    def step(self) -> list[PullDone]: ...

    def close(self) -> None: ...


class NoTransfers:
    """An aggregated server's rank."""

    endpoint = None
    busy = False

    def apply(self, op: Op) -> None:
        raise RuntimeError(f"an aggregated server's rank got {type(op).__name__}")

    def step(self) -> list[PullDone]:
        return []

    def close(self) -> None:
        return None


def make_role(cfg: ServerConfig, kv: KVCacheManager, fingerprint: str, epoch: str, rank: int,
              plan: ShardPlan) -> WorkerRole:
    if cfg.role == "aggregated":
        return NoTransfers()
    raise NotImplementedError(f"tensor parallel {cfg.role} servers")
