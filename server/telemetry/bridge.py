"""Feeds the Prometheus metrics from the engine thread.

The engine thread owns the KV manager and the scheduler, so their figures are read there, on each
tick (rate-limited), and published as immutable snapshots the HTTP thread reads at scrape time
(`kv_stats`, `counters`). The transceiver's cumulative `TransferStats` are read live at scrape time
(their writers are the sender's or receiver's threads anyway); only finished transfers are pushed,
into the transfer histogram. The cache's block events and snapshots for the router's index:
server/telemetry/kv_events.py (another tick hook).
"""

from __future__ import annotations

import time

from server.telemetry.metrics import EngineCounters, ServerMetrics, SpecCounts

SNAPSHOT_INTERVAL_S = 0.1


class TelemetryBridge:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._kv_stats = None
        self._counters = EngineCounters()
        self._last = 0.0
        self._hooked: set[int] = set()
        metrics.set_counters_provider(self.counters)

    def kv_stats(self):
        return self._kv_stats

    def counters(self) -> EngineCounters:
        return self._counters

    def on_tick(self, core) -> None:
        """After a productive step always (a scrape right after an answer sees its effect), else
        at most every SNAPSHOT_INTERVAL_S."""
        now = time.monotonic()
        if not core.did_work and now - self._last < SNAPSHOT_INTERVAL_S:
            return
        self._last = now
        self._kv_stats = core.kv.stats()
        self.metrics.set_request_counts(core.scheduler.counts())
        transfers = _transfer_stats(core)
        for stats in transfers:
            self._hook(stats)
        self._counters = EngineCounters(core.scheduler.num_preemptions, tuple(transfers), spec_counts(core))

    def _hook(self, stats) -> None:
        if id(stats) not in self._hooked:  # samples arrive as transfers end (engine or sender socket thread)
            stats.on_transfer = lambda seconds, nbytes: self.metrics.observe_transfer(nbytes, seconds)
            self._hooked.add(id(stats))


def _transfer_stats(core) -> list:
    endpoint = getattr(core.connector, "sender", None) or getattr(core.connector, "receiver", None)
    return [endpoint.stats] if endpoint is not None else []


def spec_counts(core) -> SpecCounts:
    stats = core.spec.stats  # written by the engine thread only: read there, here
    return SpecCounts(stats.proposed, stats.accepted, stats.emitted, stats.verified)
