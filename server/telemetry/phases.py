"""The phases of a request's time to first token as /metrics shows them, named once for every reader
(docs/DISAGG_LOAD.md): the router's phases, the prefill servers', a pair's generation servers'."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

ROUTER_PHASE_SECONDS = "pdserve_router_phase_seconds"
ROUTER_PHASES = ("queue", "context", "handoff", "generation", "first_event")  # its label values
QUEUE_SECONDS = "pdserve_request_queue_time_seconds"
PREFILL_SECONDS = "pdserve_prefill_seconds"
KV_TRANSFER_SECONDS = "pdserve_kv_transfer_seconds"
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0, 30.0, 120.0, 600.0)  # the router's phases: sub-millisecond ones too


@dataclass(frozen=True)
class Phase:
    name: str
    source: str  # "router", "prefill" or "generation"
    histogram: str
    router_phase: str = ""  # the router's `phase` label

    @property
    def labels(self) -> dict[str, str]:
        return {"phase": self.router_phase} if self.router_phase else {}


# in the order a disaggregated request meets them; first_event spans the router's whole wait
TTFT_PHASES = (
    Phase("router_queue", "router", ROUTER_PHASE_SECONDS, "queue"),
    Phase("context_queue", "prefill", QUEUE_SECONDS),
    Phase("prefill", "prefill", PREFILL_SECONDS),
    Phase("context_leg", "router", ROUTER_PHASE_SECONDS, "context"),
    Phase("handoff", "router", ROUTER_PHASE_SECONDS, "handoff"),
    Phase("generation_queue", "generation", QUEUE_SECONDS),
    Phase("kv_transfer", "generation", KV_TRANSFER_SECONDS),
    Phase("generation_leg", "router", ROUTER_PHASE_SECONDS, "generation"),
    Phase("first_event", "router", ROUTER_PHASE_SECONDS, "first_event"),
)


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative histogram buckets (upper bound -> count, math.inf for +Inf),
    interpolated linearly inside its bucket as Prometheus' histogram_quantile does (the highest
    finite bound if it falls in +Inf); None when the histogram is empty."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for le, count in ordered:
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = (le if not math.isinf(le) else lower), count
    return lower
