"""The context side's streamed leases (socket thread), and the test-only model of a slow link (`Pacer`).

A streamed lease is offered when its prefill starts (`Offer.final` False), its blocks PENDING until
an `Extend` brings their slots. A pull goes as far as the slots (`next_ranges`), then waits; after
the final `Extend` its `Done` carries the first token and prefix hit (only the last chunk is left).
"""

from __future__ import annotations

import time

from transceiver.sender.lease import PENDING, RELEASED, Job, Offered
from transceiver.wire import WindowRange


def next_ranges(off: Offered, job: Job) -> tuple[list[WindowRange], str | None]:
    """The blocks of `job` sendable since it last looked (it moves past them), or a sentence when
    one was released or never came."""
    out = []
    for i, r in enumerate(job.ranges):
        slots, start, stop = off.offer.windows[r.window].slots, job.planned[i], r.first + r.count
        end = start
        while end < stop and slots[end] != PENDING:
            if slots[end] == RELEASED:
                return out, f"window {r.window}: block {end} left the sliding window and was released"
            end += 1
        if end < stop and off.final:
            return out, f"window {r.window}: block {end} was never written"
        if end > start:
            out.append(WindowRange(window=r.window, first=start, count=end - start))
        job.planned[i] = end
    return out, None


def complete(off: Offered, job: Job) -> bool:
    """Every block the pull asked for is planned, and nothing more will come."""
    return off.final and all(p == r.first + r.count for p, r in zip(job.planned, job.ranges, strict=True))


class Pacer:
    """Test-only (test_link_delay_ms / test_link_bytes_per_s): the byte path sends a chunk only once
    the one before would have crossed a link of this latency and bandwidth. The socket thread does
    not sleep: `pump` is called again when the link is free."""

    def __init__(self, delay_ms: float = 0.0, bytes_per_s: int = 0) -> None:
        self._delay_s = delay_ms / 1000.0
        self._bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self.enabled = self._delay_s > 0 or self._bytes_per_s > 0

    def wait_s(self) -> float:
        """Seconds until the link takes the next chunk (0: now)."""
        return max(0.0, self._free_at - time.monotonic()) if self.enabled else 0.0

    def sent(self, nbytes: int) -> None:
        if not self.enabled:
            return
        wire = self._delay_s + (nbytes / self._bytes_per_s if self._bytes_per_s else 0.0)
        self._free_at = max(time.monotonic(), self._free_at) + wire
