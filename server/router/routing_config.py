"""The deployment YAML's routing keys under `router:` (docs/ROUTING.md), read and checked here.

```yaml
router:
  type: kv_cache_aware            # round_robin | load_balancing | kv_cache_aware | kv_cache_snapshot
  kv_weights: {primary: 1.0, secondary: 0.75}   # kv_cache_aware: value of a hit token per tier
  load_weight: 1.0                # kv_cache_aware: cost of a token a server still has to compute
  queue: {max_inflight_per_server: 64, max_waiting: 1024, timeout_s: 60}
  conditional: {max_local_prefill_length: 256, min_prefix_hit: 512}   # off unless given
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from server.config_yaml import Where
from server.router.policies import POLICIES, ScoreWeights
from server.router.queue import QueueLimits

ROUTING_KEYS = ("kv_weights", "load_weight", "queue", "conditional")


@dataclass(frozen=True)
class Conditional:
    """Requests a generation server serves alone (prefill and decode), skipping the context leg:
    those with at most `max_local_prefill_length` prompt tokens it does not hold yet, or whose
    prompt it holds at least `min_prefix_hit` tokens of (by the router's index). None: not used."""

    max_local_prefill_length: int | None = None
    min_prefix_hit: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_local_prefill_length is not None or self.min_prefix_hit is not None


@dataclass(frozen=True)
class RoutingConfig:
    weights: ScoreWeights = ScoreWeights()
    queue: QueueLimits = QueueLimits()
    conditional: Conditional = field(default_factory=Conditional)


def routing_from_yaml(router: dict[str, Any], where: Where) -> RoutingConfig:
    weights_map = where.mapping(router, "kv_weights")
    w = where.key("kv_weights")
    w.check_keys(weights_map, ("primary", "secondary"))
    weights = ScoreWeights(primary=_number(weights_map, "primary", 1.0, w),
                           secondary=_number(weights_map, "secondary", 0.75, w),
                           load=_number(router, "load_weight", 1.0, where))
    queue_map, q = where.mapping(router, "queue"), where.key("queue")
    q.check_keys(queue_map, ("max_inflight_per_server", "max_waiting", "timeout_s"))
    queue = QueueLimits(max_inflight_per_server=q.integer(queue_map, "max_inflight_per_server", 64, minimum=0),
                        max_waiting=q.integer(queue_map, "max_waiting", 1024, minimum=0),
                        timeout_s=_number(queue_map, "timeout_s", 60.0, q))
    cond_map, c = where.mapping(router, "conditional"), where.key("conditional")
    c.check_keys(cond_map, ("max_local_prefill_length", "min_prefix_hit"))
    conditional = Conditional(c.optional_integer(cond_map, "max_local_prefill_length", minimum=0),
                              c.optional_integer(cond_map, "min_prefix_hit", minimum=1))
    return RoutingConfig(weights, queue, conditional)


def _number(data: dict[str, Any], name: str, default: float, where: Where) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise where.key(name).error(f"must be a number >= 0, got {value!r}")
    return float(value)


__all__ = ["POLICIES", "ROUTING_KEYS", "Conditional", "RoutingConfig", "routing_from_yaml"]
