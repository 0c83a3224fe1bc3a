"""Prometheus metrics of one pdserve server (engine, KV cache, KV transfer).

`ServerMetrics` owns its own `CollectorRegistry` (no process globals, so several servers or tests can
live in one process). Two kinds of sources feed it:

- KV-cache figures are read at scrape time from a `stats_provider` callable that returns the KV
  manager's cumulative `KVCacheStats`; a custom collector turns that one snapshot into the gauges
  and counters, so every scrape is a consistent, exact copy of the manager's own counters.
- Engine and transfer events are pushed by the engine through the `observe_*`/`add_*`/`set_*`
  methods (prometheus_client objects: thread-safe, callable from the engine thread).

The metric names are part of the acceptance checks: keep them exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "KVStats", "ServerMetrics"]

REQUEST_STATES = ("waiting", "running", "transferring")

# Upper bounds in seconds. Small buckets first: tiny models on CPU answer in milliseconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0)


class KVStats(Protocol):
    """What the collector reads from the KV manager's cumulative `KVCacheStats`.

    `blocks` maps (window, level, state) to a block count, level in {"primary", "secondary"},
    state in {"free", "cached", "in_use"}. All other fields are cumulative since start.
    """

    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    offloads: int
    onboards: int
    bytes_offloaded: int
    bytes_onboarded: int
    bytes_copied_primary: int
    blocks: Mapping[tuple[int, str, str], int]


StatsProvider = Callable[[], KVStats | None]

# (exposed name without "_total", KVStats field, help)
_KV_COUNTERS = (
    ("pdserve_kv_offloaded_blocks", "offloads", "Blocks moved from the primary to the host pool."),
    ("pdserve_kv_onboarded_blocks", "onboards", "Blocks moved from the host back to the primary pool."),
    ("pdserve_kv_evicted_blocks", "evictions", "Cached blocks evicted from the primary pool."),
    ("pdserve_prefix_cache_query_tokens", "prefix_query_tokens", "Prompt tokens looked up for reuse."),
    ("pdserve_prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens found in the reuse tree."),
    ("pdserve_kv_offloaded_bytes", "bytes_offloaded", "Bytes copied primary -> host."),
    ("pdserve_kv_onboarded_bytes", "bytes_onboarded", "Bytes copied host -> primary."),
    ("pdserve_kv_copied_bytes", "bytes_copied_primary", "Bytes copied inside the primary pool."),
)


class _KVCacheCollector:
    """Reads one `KVStats` snapshot per scrape and exposes it (custom collector)."""

    def __init__(self) -> None:
        self.provider: StatsProvider | None = None

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.provider() if self.provider is not None else None)

    def _families(self, stats: KVStats | None) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            "pdserve_kv_cache_blocks", "KV cache blocks per window group, pool level and state.",
            labels=["window", "level", "state"],
        )
        for (window, level, state), count in sorted((stats.blocks if stats else {}).items()):
            blocks.add_metric([str(window), level, state], count)
        yield blocks
        for name, field, help_text in _KV_COUNTERS:
            family = CounterMetricFamily(name, help_text)
            if stats is not None:
                family.add_metric([], getattr(stats, field))
            yield family


class ServerMetrics:
    """All metrics of one server, in a private registry. Thread-safe."""

    def __init__(self, stats_provider: StatsProvider | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._kv = _KVCacheCollector()
        self._kv.provider = stats_provider
        self.registry.register(self._kv)
        self._make_engine_metrics()
        self._make_transfer_metrics()

    def _make_engine_metrics(self) -> None:
        reg = self.registry
        self._requests = Gauge("pdserve_requests", "Requests per scheduler state.", ["state"], registry=reg)
        for state in REQUEST_STATES:
            self._requests.labels(state).set(0)
        self._known_states: set[str] = set(REQUEST_STATES)
        self._ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token.",
                               buckets=TTFT_BUCKETS, registry=reg)
        self._tpot = Histogram("pdserve_time_per_output_token_seconds", "Time between output tokens.",
                               buckets=TPOT_BUCKETS, registry=reg)
        self._gen_tokens = Counter("pdserve_generation_tokens", "Generated tokens.", registry=reg)
        self._preemptions = Counter("pdserve_preemptions", "Running requests preempted for lack of KV blocks.",
                                    registry=reg)

    def _make_transfer_metrics(self) -> None:
        reg = self.registry
        self._xfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved by the transceiver.",
                                   registry=reg)
        self._xfer_seconds = Histogram("pdserve_kv_transfer_seconds", "One request's KV transfer time.",
                                       buckets=TRANSFER_BUCKETS, registry=reg)
        self._xfer_failures = Counter("pdserve_kv_transfer_failures", "Failed KV transfers by reason.",
                                      ["reason"], registry=reg)
        self._lease_expired = Counter("pdserve_kv_transfer_lease_expired",
                                      "Context-side block leases that expired before the transfer ended.",
                                      registry=reg)
        self._rejected = Counter("pdserve_kv_transfer_rejected_messages",
                                 "Transceiver messages dropped (bad MAC, version or encoding).", registry=reg)

    # -- KV cache (read at scrape time) -------------------------------------------------------------

    def set_stats_provider(self, provider: StatsProvider | None) -> None:
        """Set the callable returning the KV manager's cumulative stats (called at every scrape)."""
        self._kv.provider = provider

    # -- engine ---------------------------------------------------------------------------------------

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self._tpot.observe(seconds)

    def add_generation_tokens(self, n: int) -> None:
        self._gen_tokens.inc(n)

    def add_preemptions(self, n: int) -> None:
        self._preemptions.inc(n)

    def set_request_counts(self, counts: Mapping[str, int]) -> None:
        """Set the number of requests per state; a state seen before but absent from `counts` is 0."""
        self._known_states.update(counts)
        for state in self._known_states:
            self._requests.labels(state).set(counts.get(state, 0))

    # -- KV transfer (disaggregation) -----------------------------------------------------------------

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        """One request's completed KV transfer."""
        self._xfer_bytes.inc(num_bytes)
        self._xfer_seconds.observe(seconds)

    def add_transfer_failure(self, reason: str) -> None:
        self._xfer_failures.labels(reason).inc()

    def add_lease_expired(self, n: int = 1) -> None:
        self._lease_expired.inc(n)

    def add_rejected_message(self, n: int = 1) -> None:
        self._rejected.inc(n)

    # -- exposition -----------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (content type `CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)
