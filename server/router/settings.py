"""The router's settings that the deployment YAML names: its policies, kv_cache_aware's weights and
the queue's limits. Plain values with no HTTP client behind them, so that `server.config` (read by
every server and the launcher) does not import the router's machinery (aiohttp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta

from kvcache import Level

POLICIES = ("round_robin", "load_balancing", "kv_cache_aware")


@dataclass(frozen=True)
class ScoreWeights:
    """kv_cache_aware's weights (router.kv_weights, router.load_weight)."""

    primary: float = 1.0  # a block on the device pool (GPU; the CPU pool on a machine without one)
    secondary: float = 0.75  # a block on the host tier: onboarded (copied back) before reuse
    load: float = 1.0  # per token the server still has to compute for the router's legs in flight
    disk: float = 0.25  # a block on the disk tier: read back and checked, then onboarded (Dynamo's 0.25)

    def tier(self, level: int) -> float:
        return {Level.PRIMARY: self.primary, Level.SECONDARY: self.secondary, Level.DISK: self.disk}[level]


class QueueLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`router.queue` of the deployment YAML."""

    max_inflight_per_server: Annotated[int, Meta(ge=0)] = 64  # 0: a server is never saturated
    max_waiting: Annotated[int, Meta(ge=0)] = 1024
    timeout_s: Annotated[float, Meta(ge=0)] = 60.0
