"""Feeds the Prometheus metrics from the engine thread.

The engine thread owns the KV manager and the transceiver, so their counters are read there, on
each tick (rate-limited), and published as immutable snapshots the HTTP thread reads at scrape
time. Transfer counters are forwarded as deltas. The cache's block events and snapshots for the
router's index: server/kv_events.py (another tick hook).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.metrics import ServerMetrics

SNAPSHOT_INTERVAL_S = 0.1


@dataclass
class _Seen:
    failures: dict[str, int] = field(default_factory=dict)
    lease_expired: int = 0
    rejected: int = 0


class TelemetryBridge:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._kv_stats = None
        self._last = 0.0
        self._seen: dict[int, _Seen] = {}
        self._preemptions = 0
        self._hooked: set[int] = set()
        self._preemptions = 0

    def kv_stats(self):
        return self._kv_stats

    def on_tick(self, core) -> None:
        """After a productive step always (a scrape right after an answer sees its effect), else
        at most every SNAPSHOT_INTERVAL_S."""
        now = time.monotonic()
        if not core.did_work and now - self._last < SNAPSHOT_INTERVAL_S:
            return
        self._last = now
        self._kv_stats = core.kv.stats()
        self.metrics.set_request_counts(core.scheduler.counts())
        if core.scheduler.num_preemptions > self._preemptions:
            self.metrics.add_preemptions(core.scheduler.num_preemptions - self._preemptions)
            self._preemptions = core.scheduler.num_preemptions
        for stats in _transfer_stats(core):
            self._forward_transfer(stats)

    def _forward_transfer(self, stats) -> None:
        key = id(stats)
        if key not in self._hooked:  # samples arrive as transfers end (engine or sender socket thread)
            stats.on_transfer = lambda seconds, nbytes: self.metrics.observe_transfer(nbytes, seconds)
            self._hooked.add(key)
        seen = self._seen.setdefault(key, _Seen())
        for reason, count in list(stats.failures_by_reason.items()):
            delta = count - seen.failures.get(reason, 0)
            for _ in range(delta):
                self.metrics.add_transfer_failure(reason)
            seen.failures[reason] = count
        if stats.lease_expired > seen.lease_expired:
            self.metrics.add_lease_expired(stats.lease_expired - seen.lease_expired)
            seen.lease_expired = stats.lease_expired
        if stats.rejected_messages > seen.rejected:
            self.metrics.add_rejected_message(stats.rejected_messages - seen.rejected)
            seen.rejected = stats.rejected_messages


def _transfer_stats(core) -> list:
    endpoint = getattr(core.connector, "sender", None) or getattr(core.connector, "receiver", None)
    return [endpoint.stats] if endpoint is not None else []
